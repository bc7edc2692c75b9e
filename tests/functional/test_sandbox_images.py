"""Restore recreates what the images expect on this machine: the directories of bound unix
sockets (multiprocessing's listeners live in a temporary directory its owner removes)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _criu_ready

pytestmark = pytest.mark.timeout(120)

SERVER = """
import os, socket, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(d, "listener"))
s.listen(4)
print("ready", flush=True)
n = 0
while True:
    c, _ = s.accept()
    n += 1
    c.sendall(f"{n}\\n".encode())
    c.close()
"""


@pytest.fixture()
def sandboxes() -> Iterator[list]:
    if _criu_ready():
        pytest.skip(_criu_ready())
    from snapshotter.sandbox.spawn import become_subreaper

    become_subreaper()
    made: list = []
    yield made
    for sb in made:
        sb.kill()
        sb.wait(10)


def _ask(path: str) -> bytes:
    c = socket.socket(socket.AF_UNIX)
    c.connect(path)
    try:
        return c.recv(64)
    finally:
        c.close()


def test_restore_recreates_missing_socket_directory(tmp_path: Path, sandboxes: list) -> None:
    from snapshotter.sandbox import criu
    from snapshotter.sandbox.images import bound_unix_paths
    from snapshotter.sandbox.spawn import spawn

    sock_dir = tmp_path / "pymp-xyz"
    script = tmp_path / "srv.py"
    script.write_text(SERVER)
    sb = spawn([sys.executable, str(script), str(sock_dir)], dict(os.environ), str(tmp_path),
               init_cwd=tmp_path / "init")
    sandboxes.append(sb)
    got = b""
    while not got.endswith(b"\n"):  # PYTHONUNBUFFERED=1 makes print() write twice
        chunk = os.read(sb.io.stdout, 64)
        assert chunk, got
        got += chunk
    assert got == b"ready\n"
    listener = str(sock_dir / "listener")
    assert _ask(listener) == b"1\n"
    images = tmp_path / "img"
    images.mkdir()
    criu.dump(sb.pid, images, leave_running=False, log_dir=tmp_path / "logs")
    sb.wait(10)
    assert bound_unix_paths(images) == [listener]

    shutil.rmtree(sock_dir)  # what the owner's exit does
    restored = criu.restore(images, dict(sb.io.inodes), log_dir=tmp_path / "logs2")
    sandboxes.append(restored)
    assert _ask(listener) == b"2\n"  # the restored server, counting on from its state
