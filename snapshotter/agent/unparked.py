"""What a rank that did not park within a freeze's deadline was doing, in one line.

A pure function of what the rank reported when asked afterwards (hook/protocol.py's
`Progress` with `where`): its barrier's state, how far each group got against the freeze's
targets, how long its oldest collective has been in flight and where its threads are. The
coordinator puts the line in the freeze's error, so an operator sees whether the rank waits
on a peer's collective, on a group behind the others, or on something outside collectives.
"""

from __future__ import annotations

from collections.abc import Mapping

from snapshotter.hook.protocol import Progress

WHERE_WAIT_S = 2.0  # how long the agent waits for that report after the deadline


def unparked(cause: str, targets: Mapping[str, int], seen: Progress | None) -> str:
    """`cause` (why the wait ended), then what the rank reported, if it answered."""
    if seen is None:
        return f"{cause}; it did not answer a progress query either (busy holding the GIL, " \
               "stopped, or hung outside Python)"  # fmt: skip
    parts = [cause, f"its barrier is {seen.state or 'unknown'}"]
    behind = []
    for group, target in sorted(targets.items()):
        issued = seen.counts.get(group)
        if issued is not None and issued < target - 1:
            behind.append(f"group {group} issued {issued} of the {target - 1} another rank "
                          "issued")  # fmt: skip
    parts.append("; ".join(behind) if behind else "no group behind the others")
    if seen.in_flight_s > 0:
        parts.append(f"a collective in flight for {seen.in_flight_s:.0f}s")
    if seen.where:
        parts.append("threads: " + " | ".join(seen.where))
    return "; ".join(parts)
