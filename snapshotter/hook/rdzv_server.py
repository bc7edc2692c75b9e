"""The job's c10d TCPStore server, hosted outside the ranks so no rank owns a listening socket.

    python -m snapshotter.hook.rdzv_server --host H --port 0

Prints one JSON line {"host": H, "port": P} on stdout once the store listens, then serves until
SIGTERM/SIGINT or EOF on stdin. The agent starts it with the job's Python (it needs torch), and
starts a fresh one, on a new port, for every resume.

    python -m snapshotter.hook.rdzv_server --standby

imports torch first, prints {"ready": true} and waits for one JSON line on stdin
({"host": H, "port": P}) before it listens: a spare the agent keeps ready, so that a thaw
(a recovery) does not wait for the import.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snapshotter.hook.rdzv_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--standby", action="store_true")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    if args.standby:
        print(json.dumps({"ready": True}), flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0  # let go unused
        where = json.loads(line)
        args.host, args.port = str(where["host"]), int(where["port"])

    store = dist.TCPStore(
        args.host,
        args.port,
        None,
        True,
        timedelta(seconds=args.timeout_s),
        wait_for_workers=False,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def watch_stdin() -> None:
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(json.dumps({"host": args.host, "port": store.port}), flush=True)
    while not stop.wait(0.5):
        pass
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
