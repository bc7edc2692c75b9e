"""The in-rank hook: makes a training script's process groups freezable without touching it.

`bootstrap` starts the rank, `control` speaks the agent's protocol, `barrier` decides where
collectives stop, `resumable` and `store` keep the script's handles valid while their sockets
are closed and re-opened. Only stdlib and torch may be imported here: ranks may lack anything else.
"""
