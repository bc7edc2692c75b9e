"""Where a rank's threads are: one line per thread, for the agent to name what a rank that
did not park waits on (a collective of its own, a save's upload, a lock, a sleep).

Read from `sys._current_frames()` on the control thread: threads blocked in C code (a
collective, a lock, a sleep) release the GIL, so this answers while they stay blocked. It reads
the frames only; it never touches the threads' state.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType

from snapshotter.hook.protocol import MAX_WHERE, MAX_WHERE_CHARS

FRAMES = 4  # innermost frames shown per thread


def _frame(f: FrameType) -> str:
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"


def where(skip: int | None = None, frames: int = FRAMES) -> list[str]:
    """`name: innermost < caller < ...` for every thread but `skip` (default: the caller's)."""
    skip = threading.get_ident() if skip is None else skip
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, top in sorted(sys._current_frames().items(), key=lambda kv: kv[0]):
        if ident == skip:
            continue
        chain: list[str] = []
        f: FrameType | None = top
        while f is not None and len(chain) < frames:
            chain.append(_frame(f))
            f = f.f_back
        name = names.get(ident, f"thread {ident}")
        lines.append(f"{name}: {' < '.join(chain)}"[:MAX_WHERE_CHARS])
    return lines[:MAX_WHERE]
