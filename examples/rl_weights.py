"""Reinforcement learning with weight push: a trainer learns a policy from rollouts that
replica jobs generate on other nodes, and pushes each new version of its weights to them.

    # two rollout replicas, each a job of its own on another node
    snapshotter run --nodes b examples/rl_weights.py --role replica --rollouts /shared/rl
    snapshotter run --nodes c examples/rl_weights.py --role replica --rollouts /shared/rl
    # the trainer
    snapshotter run --nodes a examples/rl_weights.py --role trainer --rollouts /shared/rl

The task is a contextual bandit: a context of 8 numbers, 4 actions, reward 1 for the action a
hidden linear rule prefers. A replica updates its policy in place with the newest version its
node holds (`Subscription.update`, between rollouts only, so a rollout never mixes two
versions), samples a rollout and writes it, with the version it used, into `--rollouts` (a
directory both sides see; the weights themselves never pass through it). The trainer takes
whatever rollouts are there, makes one policy-gradient step and publishes the next version
(`weights.publish`, which returns once the weights are copied into shared memory): it never
waits for a particular replica, so a slow or dead replica costs it nothing but samples.

Each side prints one line per step (the trainer: `version V reward R from versions [...]`,
a replica: `rollout N version V reward R`); `--out FILE` writes them as JSON, with a digest
of the weights each version had, so a test can check every rollout against the trainer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from snapshotter import weights

CONTEXT, ACTIONS, BATCH = 8, 4, 256


def policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(CONTEXT, 64), torch.nn.Tanh(), torch.nn.Linear(64, ACTIONS)
    )


def best_actions(x: torch.Tensor) -> torch.Tensor:
    rule = torch.randn(CONTEXT, ACTIONS, generator=torch.Generator().manual_seed(7))
    return (x @ rule).argmax(dim=1)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def replica(a: argparse.Namespace, out: dict[str, Any]) -> None:
    net = policy()
    sub = weights.subscribe(a.channel)
    sub.update(net, wait=True, timeout=a.first_timeout)
    rollouts = Path(a.rollouts)
    me = a.name or os.environ.get("SNAPSHOTTER_JOB_ID", str(os.getpid()))
    out["rollouts"] = []
    n = 0
    while not (rollouts / "done").exists() and n < a.max_rollouts:
        sub.update(net)  # between rollouts only: a rollout runs wholly on one version
        version, before = sub.version, digest(net)
        g = torch.Generator().manual_seed(zlib.crc32(f"{me}-{n}".encode()))
        x = torch.randn(BATCH, CONTEXT, generator=g)
        with torch.no_grad():
            probs = torch.softmax(net(x), dim=1)
        act = torch.multinomial(probs, 1, generator=g).squeeze(1)
        reward = (act == best_actions(x)).float()
        time.sleep(a.gen_s)  # the generation a real replica spends its time on
        after = digest(net)
        tmp = rollouts / f".{me}-{n}.tmp"
        torch.save({"x": x, "action": act, "reward": reward, "version": version}, tmp)
        os.replace(tmp, rollouts / f"{me}-{n}.pt")
        out["rollouts"].append({"n": n, "version": version, "before": before, "after": after,
                                "reward": float(reward.mean())})  # fmt: skip
        print(f"rollout {n} version {version} reward {reward.mean():.3f}", flush=True)
        n += 1


def take_rollouts(d: Path, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(d.glob("*.pt"))
        if files:
            got = [torch.load(f) for f in files]
            for f in files:
                f.unlink()
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"no rollouts in {d} for {timeout:.0f} s: are replicas running?")
        time.sleep(0.02)


def trainer(a: argparse.Namespace, out: dict[str, Any]) -> None:
    net = policy()
    opt = torch.optim.Adam(net.parameters(), lr=a.lr)
    rollouts = Path(a.rollouts)
    (rollouts / "done").unlink(missing_ok=True)
    out["versions"] = {1: digest(net)}
    out["steps"] = []
    weights.publish(net, version=1, channel=a.channel)
    for version in range(2, a.versions + 1):
        batch = take_rollouts(rollouts, a.rollout_timeout)
        x = torch.cat([b["x"] for b in batch])
        act = torch.cat([b["action"] for b in batch])
        reward = torch.cat([b["reward"] for b in batch])
        logp = torch.log_softmax(net(x), dim=1).gather(1, act[:, None]).squeeze(1)
        loss = -((reward - reward.mean()) * logp).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        weights.publish(net, version=version, channel=a.channel)  # returns once staged
        out["versions"][version] = digest(net)
        used = sorted({int(b["version"]) for b in batch})
        out["steps"].append({"version": version, "reward": float(reward.mean()), "used": used})
        print(f"version {version} reward {reward.mean():.3f} from versions {used}", flush=True)
    weights.flush(a.channel)
    time.sleep(a.linger_s)  # let the replicas take the last version before they stop
    (rollouts / "done").touch()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["trainer", "replica"], required=True)
    p.add_argument("--rollouts", required=True, help="a directory trainer and replicas share")
    p.add_argument("--channel", default="policy")
    p.add_argument("--versions", type=int, default=40, help="trainer: versions to publish")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--rollout-timeout", type=float, default=120.0)
    p.add_argument("--linger-s", type=float, default=2.0)
    p.add_argument("--gen-s", type=float, default=0.05, help="replica: seconds per rollout")
    p.add_argument("--max-rollouts", type=int, default=100000)
    p.add_argument("--first-timeout", type=float, default=300.0)
    p.add_argument("--name", default="", help="replica: names its rollout files")
    p.add_argument("--out", default="")
    a = p.parse_args()
    Path(a.rollouts).mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"role": a.role}
    try:
        (trainer if a.role == "trainer" else replica)(a, out)
    finally:
        if a.out:
            Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
