"""Stand-ins for parts this machine may not have, for tests and rehearsals only.

gpu_fake   the CUDA checkpoint driver (cuda.bindings.driver) as a state machine: used where
           no NVIDIA driver exists (CI), so the real snapshotter/gpu/cuda.py code runs against
           it; `bench/gpu_check.sh --rehearse` drives a whole freeze/thaw through it.

Nothing in the production package imports from here.
"""
