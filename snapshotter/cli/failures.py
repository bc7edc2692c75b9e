"""The summary of a failed job, laid out as torchrun prints it, so people and the tools that
read torchrun's output find the root cause where they expect it.

    ============================================================
    train.py FAILED
    ------------------------------------------------------------
    Failures:
    [1]:
      time      : 2026-12-05_13:05:48
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 7721)
      traceback : Signal 9 (SIGKILL) received by PID 7721
    ------------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      ...
    ============================================================

The root cause is the rank whose failure made its agent end the others (`failed_first`), its
traceback as its `@record` wrote it (RankState.error). Pure: a job status in, text out.
"""

from __future__ import annotations

import signal
import time
from typing import Any

Msg = dict[str, Any]
_RULE, _THIN = "=" * 60, "-" * 60


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(t)) if t else "<N/A>"


def _why(r: Msg) -> str:
    if r.get("error"):
        return str(r["error"])
    code = r.get("exit_code")
    # A signal: negative as Python reports it, or 128 + N as the sandbox's init passes it on.
    sig = -code if isinstance(code, int) and code < 0 else \
        code - 128 if isinstance(code, int) and 128 < code < 128 + 65 else 0  # fmt: skip
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"Signal {sig} ({name}) received by PID {r.get('pid', '?')}"
    return "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"


def _entry(r: Msg) -> list[str]:
    lines = [
        f"[{r['rank']}]:",
        f"  time      : {_when(float(r.get('error_time') or 0))}",
        f"  rank      : {r['rank']} (local_rank: {r.get('local_rank', 0)})",
        f"  exitcode  : {r.get('exit_code')} (pid: {r.get('pid', '?')})",
    ]
    why = _why(r).rstrip("\n").splitlines() or [""]
    lines.append(f"  traceback : {why[0]}")
    lines += [f"  {line}" for line in why[1:]]
    return lines


def summary(st: Msg) -> str:
    """torchrun's failure summary for a FAILED job status (plain JobStatus); "" otherwise or
    when no rank failed."""
    failed = [r for r in st.get("ranks", []) if r.get("exit_code") not in (None, 0)]
    if st.get("state") != "FAILED" or not failed:
        return ""
    first = next((r for r in failed if r.get("failed_first")), None) or min(
        failed, key=lambda r: (float(r.get("error_time") or 0) or float("inf"), r["rank"]))
    others = [r for r in failed if r is not first]
    lines = [_RULE, f"{st.get('script', 'job')} FAILED", _THIN, "Failures:"]
    if others:
        for r in others:
            lines += _entry(r)
    else:
        lines.append("  <NO_OTHER_FAILURES>")
    lines += [_THIN, "Root Cause (first observed failure):", *_entry(first), _RULE]
    return "\n".join(lines)
