"""After an agent restart: bring back to running the ranks a freeze of the previous agent left
held (parked or suspended), so that our own restart never leaves a job half-frozen.

The keeper keeps the ranks' control pipes open across the restart, so a rank suspended for a
dump (communicators torn down) waits there for a resume that its dead agent will never send.
The new agent asks every re-adopted rank for its barrier state (the `progress` reply) and:

* none held                       -> nothing;
* some held, none suspended       -> abort on every rank (each lets its parked thread go);
* some suspended, all ranks here  -> suspend the parked ones too, then resume every rank
                                     against the job's rendezvous (a rebuild is collective);
* some suspended, ranks elsewhere -> nothing here: the job's other nodes must rebuild with
                                     them; the coordinator's recovery does that.

`plan` is the decision, pure; `settle` carries it out.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence

from snapshotter.agent.runtime import NodeJob
from snapshotter.hook import protocol

log = logging.getLogger(__name__)

HELD = {"holding", "armed", "parked", "suspended"}
ASK_S = 10.0


class Plan(enum.Enum):
    NOTHING = "nothing"
    ABORT = "abort"
    RESUME = "resume"
    LEAVE = "leave"  # suspended ranks whose peers on other nodes must resume with them


def plan(states: Sequence[str], all_ranks_here: bool) -> Plan:
    """What to do with a re-adopted job whose ranks report these barrier states ("" for a
    rank that did not answer or runs an older hook)."""
    if "suspended" in states:
        return Plan.RESUME if all_ranks_here else Plan.LEAVE
    if any(s in HELD for s in states):
        return Plan.ABORT
    return Plan.NOTHING


def settle(job: NodeJob, resume: Callable[[NodeJob, str], None], timeout: float = 120.0) -> Plan:
    """Carry out `plan` for `job`; `resume(job, epoch)` rebuilds every rank's communicators.
    Returns what was done; a failure is logged (the job's own failure detection sees a rank
    that stays held)."""
    states = []
    for r in job.ranks:
        got = r.channel.progress(ASK_S)
        states.append(got.state if got is not None else "")
    here = job.spec.nnodes == 1
    decided = plan(states, here)
    epoch = f"readopt-{int(time.time() * 1000)}"
    job_id = job.spec.job_id
    try:
        if decided is Plan.ABORT:
            job.each(lambda r: r.channel.request(protocol.abort(epoch), timeout), len(job.ranks))
        elif decided is Plan.RESUME:
            for r, s in zip(job.ranks, states, strict=True):
                if s == "parked":
                    r.channel.request(protocol.suspend(epoch), timeout)
            resume(job, epoch)
        elif decided is Plan.LEAVE:
            log.warning("job %s: ranks left suspended by the previous agent wait for the "
                        "coordinator's recovery (the job spans other nodes)", job_id)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - logged; detection and recovery take it from here
        log.error("job %s: could not bring back the ranks the previous agent left held "
                  "(%s): %s", job_id, ", ".join(states), e)  # fmt: skip
        return decided
    if decided in (Plan.ABORT, Plan.RESUME):
        log.warning("job %s: the previous agent left its ranks held (%s); %s them",
                    job_id, ", ".join(states),
                    "aborted" if decided is Plan.ABORT else "resumed")  # fmt: skip
    return decided
