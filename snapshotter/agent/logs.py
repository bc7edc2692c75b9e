"""Per-rank log files fed from the pipes the agent owns.

A rank never writes a file itself (a regular file that changes size between dump and restore
breaks CRIU restore); it writes into pipes, and these pumps append what arrives to
`<home>/jobs/<job>/logs/rank-<r>.log`. After a thaw, new pumps append to the same files.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path


class KeptPump:
    """The agent's keeper pumps this rank's output into its log: nothing to wait for here."""

    def join(self, timeout: float | None = None) -> None:
        return None


class LogPump:
    """Copies everything readable from `fds` to `path` until every fd reaches EOF."""

    def __init__(self, path: Path, fds: list[int]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by the last pump
        self._lock = threading.Lock()
        self._open = len(fds)
        self._threads = [
            threading.Thread(target=self._pump, args=(fd,), daemon=True, name=f"log-{path.name}")
            for fd in fds
        ]
        for t in self._threads:
            t.start()

    def _pump(self, fd: int) -> None:
        try:
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break
                if not data:
                    break
                with self._lock:
                    self._file.write(data)
        finally:
            try:
                os.close(fd)
            except OSError:
                pass
            with self._lock:
                self._open -= 1
                if self._open == 0:
                    self._file.close()

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout)


def follow_file(
    path: Path, offset: int, follow: bool, finished: Callable[[], bool], poll: float = 0.2
) -> Iterator[tuple[int, bytes]]:
    """Yield (offset, data) from `path`; with `follow`, keep going until `finished()`."""
    while not path.exists():
        if not follow or finished():
            return
        time.sleep(poll)
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            data = f.read(65536)
            if data:
                yield offset, data
                offset += len(data)
                continue
            if not follow:
                return
            if finished():
                data = f.read()
                if data:
                    yield offset, data
                return
            time.sleep(poll)
