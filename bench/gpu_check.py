"""Device check: freeze and thaw real CUDA jobs through the agent's own pieces, and time it.

Three cases, each against an uninterrupted reference run of the same job:
  single  one CUDA training process, no process group
  nccl    one DDP rank over NCCL (NCCL refuses two ranks on one GPU: "Duplicate GPU
          detected", so with one GPU the NCCL communicator's suspend/rebuild is checked alone)
  gloo2   two DDP ranks over gloo with CUDA tensors, sharing GPU 0 (two processes' GPU
          state checkpointed in parallel)
  migrate two DDP ranks over gloo sharing GPU 0, rank 1 moved to a new sandbox on the same
          GPU while rank 0 stays in memory: only rank 1 is GPU-checkpointed and dumped, its
          images go through the agents' transfer (agent/handoff.py, minus gRPC), it is
          restored and GPU-restored, and both ranks rebuild under one epoch
  steptime  what the hook costs between freezes: bench/hook_job.py (DDP over NCCL with small
          gradient buckets, one rank) under the hook vs plain, paired runs alternating which
          goes first; reports the median step times and the median per-pair ratio (no freeze)

For each: (a) freeze-and-continue (park, suspend, GPU lock+checkpoint, CRIU dump, GPU
restore+unlock, resume) and the job must finish bit-identical to the reference; (b) thaw the
dumped images as a new job (CRIU restore, GPU restore+unlock, resume with a new store) and it
must finish bit-identical too. Reports GB/s of GPU state captured and restored and the stall.

Uses only stdlib, torch and cuda-python beside snapshotter itself (no gRPC, no object store),
because the device machine has no package registry. `--driver fake --device cpu` runs the
same orchestration on a machine without a GPU (the rehearsal): the fake driver stands in for
cuda.bindings.driver and the job trains on CPU over gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapshotter.agent.logs import LogPump  # noqa: E402
from snapshotter.agent.rankctl import RankChannel  # noqa: E402
from snapshotter.agent.rdzv import RdzvServer  # noqa: E402
from snapshotter.coordinator.decisions import pick_targets  # noqa: E402
from snapshotter.gpu.cuda import CudaDriver, detect  # noqa: E402
from snapshotter.gpu.stage import GpuStage, GpuStageSettings  # noqa: E402
from snapshotter.hook import protocol  # noqa: E402
from snapshotter.hook.barrier import CHANNEL_MARK  # noqa: E402
from snapshotter.launch.env import placements, rank_argv, rank_env, resume_env  # noqa: E402
from snapshotter.sandbox import criu  # noqa: E402
from snapshotter.sandbox.spawn import PRIVATE_TMP, Sandbox, become_subreaper, spawn  # noqa: E402

JOB = ROOT / "bench" / "gpu_job.py"
HOOK_JOB = ROOT / "bench" / "hook_job.py"
T = 120.0  # every control request's timeout


def out(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


class Job:
    """A node's ranks, as the agent holds them: sandbox, control channel, log file."""

    def __init__(
        self, work: Path, name: str, nproc: int, args: list[str], script: Path = JOB
    ) -> None:
        self.work, self.name, self.nproc, self.args = work, name, nproc, args
        self.script = script
        self.store = RdzvServer(sys.executable, "127.0.0.1", {"PATH": "/usr/bin:/bin"})
        self.sandboxes: list[Sandbox] = []
        self.channels: list[RankChannel] = []
        self.pumps: list[LogPump] = []
        self.inits: list[str] = []

    def log(self, rank: int) -> Path:
        return self.work / f"{self.name}-rank{rank}.log"

    def _attach(self, rank: int, sb: Sandbox) -> None:
        self.sandboxes.append(sb)
        ctl_in, ctl_out, stdout, stderr = sb.io.take("ctl_in", "ctl_out", "stdout", "stderr")
        self.channels.append(RankChannel(rank, ctl_in, ctl_out))
        self.pumps.append(LogPump(self.log(rank), [stdout, stderr]))

    def start(self, env: dict[str, str]) -> None:
        argv = rank_argv(sys.executable, str(self.script), self.args, False)
        for p in placements(1, self.nproc, 0):
            cwd = self.work / f"init-{self.name}-{p.rank}-{uuid.uuid4().hex[:6]}"
            cwd.mkdir(parents=True)
            self.inits.append(str(cwd))
            e = rank_env(env, p, self.store.address, self.name)
            self._attach(p.rank, spawn(argv, e, str(ROOT), init_cwd=cwd, private_tmp=PRIVATE_TMP))

    def restore(self, images: Path, inodes: list[dict[str, int]], inits: list[str]) -> None:
        for rank in range(self.nproc):
            Path(inits[rank]).mkdir(parents=True, exist_ok=True)
            sb = criu.restore(images / f"rank-{rank}", inodes[rank],
                              log_dir=self.work / "criu-logs" / f"restore-{rank}")
            self._attach(rank, sb)

    def step(self) -> int:
        """The step every rank has reached (a rank still starting up counts as -1)."""
        steps = []
        for r in range(self.nproc):
            found = re.findall(r"^step (\d+)$", self.log(r).read_text(errors="replace"), re.M)
            steps.append(int(found[-1]) if found else -1)
        return min(steps)

    def wait_step(self, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < n:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: step {n} not reached; see {self.log(0)}")
            time.sleep(0.05)

    def _check_alive(self) -> None:
        for r, sb in enumerate(self.sandboxes):
            if sb.poll() not in (None, 0):
                raise RuntimeError(f"{self.name} rank {r} died: {self.log(r).read_text()[-3000:]}")

    def results(self, timeout: float = 600) -> list[dict[str, Any]]:
        for sb in self.sandboxes:
            code = sb.wait(timeout)
            if code != 0:
                raise RuntimeError(f"{self.name} exited {code}: {self.log(0).read_text()[-3000:]}")
        for p in self.pumps:
            p.join(timeout=5)
        res = []
        for r in range(self.nproc):
            m = re.findall(r"^RESULT (.*)$", self.log(r).read_text(errors="replace"), re.M)
            # stdout and stderr share the log: a warning may follow the JSON on its line
            res.append(json.JSONDecoder().raw_decode(m[-1])[0])
        return res

    def each(self, fn: Callable[[int], Any]) -> list[Any]:
        got: dict[int, Any] = {}
        errs: list[BaseException] = []

        def run(r: int) -> None:
            try:
                got[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errs.append(e)

        ts = [threading.Thread(target=run, args=(r,)) for r in range(self.nproc)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]
        return [got[r] for r in range(self.nproc)]

    def quiesce(self, fid: str) -> None:
        counts = self.each(
            lambda r: self.channels[r].request(protocol.prepare(fid), T)["counts"]
        )
        targets = pick_targets(dict(enumerate(counts)))
        for ch in self.channels:
            ch.send(protocol.park(fid, targets))
        self.each(lambda r: self.channels[r].expect("parked", fid, T))
        self.each(lambda r: self.channels[r].request(protocol.suspend(fid), T))

    def resume(self, fid: str, rdzv: RdzvServer) -> None:
        a = rdzv.address
        msg = protocol.resume(fid, fid, a.host, a.port, resume_env(a, {}))
        self.each(lambda r: self.channels[r].request(dict(msg), T))

    def close(self) -> None:
        for sb in self.sandboxes:
            if sb.poll() is None:
                sb.kill()
                sb.wait(10)
        self.store.stop()


def telemetry(job: Job) -> dict[int, Any]:
    """What each rank's hook says of its latest steps and collectives (what `snapshotter top`
    reads): on NCCL groups the Python path stamps each op's latency when the rank sees it
    done; on gloo the native gate stamps it on the op's completion."""
    out: dict[int, Any] = {}
    for r, ch in enumerate(job.channels):
        p = ch.progress(5.0)
        if p is None:
            out[r] = None
            continue
        out[r] = {"steps": p.steps, "step_ms": round(p.step_s * 1e3, 2),
                  "groups": {k: {"done": t.done, "mean_ms": round(t.mean_s * 1e3, 3),
                                 "aligned": len(t.recent)}
                             for k, t in p.timings.items() if CHANNEL_MARK not in k}}  # fmt: skip
    return out


def case(name: str, nproc: int, extra: list[str], a: argparse.Namespace, stage: GpuStage,
         fake: Any, work: Path) -> dict[str, Any]:
    args = ["--steps", str(a.steps), "--device", a.device, "--width", str(a.width),
            "--layers", str(a.layers), "--step-sleep", str(a.step_sleep), *extra]
    # The machine's own environment (driver library paths, CUDA_*/NVIDIA_* settings), as
    # `snapshotter run` passes the caller's.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "SNAPSHOTTER_HOLD_S": "120"}
    res: dict[str, Any] = {"case": name, "nproc": nproc}

    ref = Job(work, f"{name}-ref", nproc, args)
    try:
        ref.start(env)
        reference = ref.results()
        res["reference"] = [r["digest"][:16] for r in reference]
    finally:
        ref.close()

    job = Job(work, f"{name}-live", nproc, args)
    images = work / f"{name}-images"
    try:
        job.start(env)
        job.wait_step(a.freeze_at)
        if fake is not None:  # the fake learns which processes "have CUDA state"
            from snapshotter.gpu.stage import sandbox_pids

            for sb in job.sandboxes:
                fake.add_process(sandbox_pids(sb.pid)[0])
        tele = telemetry(job)
        res["telemetry"] = tele
        # A single process has no group, hence no collectives to time.
        res["telemetry_ok"] = all(
            t is not None and t["step_ms"] > 0 and (bool(t["groups"]) or nproc == 1)
            and all(g["done"] > 0 and g["mean_ms"] > 0 for g in t["groups"].values())
            for t in tele.values()
        )
        fid = f"f{uuid.uuid4().hex[:8]}"
        t_park = time.monotonic()
        job.quiesce(fid)
        t0 = time.monotonic()
        hold = stage.freeze({r: sb.pid for r, sb in enumerate(job.sandboxes)})
        t_ckpt = time.monotonic() - t0
        t1 = time.monotonic()
        dump_error = None
        try:
            job.each(lambda r: criu.dump(job.sandboxes[r].pid, images / f"rank-{r}",
                                         leave_running=True,
                                         log_dir=work / "criu-logs" / f"{name}-dump-{r}"))
        except Exception as e:  # noqa: BLE001 - the driver round trip is still checked
            dump_error = f"{type(e).__name__}: {e}"[-3000:]
        t_dump = time.monotonic() - t1
        t2 = time.monotonic()
        stage.release(hold)
        t_release = time.monotonic() - t2
        job.resume(fid, job.store)
        stall = time.monotonic() - t_park
        gpu_bytes = hold.state_bytes()
        recorded = {r: rg.gpus for r, rg in hold.ranks.items()}
        image_bytes = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
        live = job.results()
        inodes = [dict(sb.io.inodes) for sb in job.sandboxes]
        inits = list(job.inits)
    finally:
        job.close()
    res.update(
        freeze_continue_identical=[r["digest"] for r in live] == [r["digest"] for r in reference],
        gpu_state_bytes=gpu_bytes, image_bytes=image_bytes,
        gpu_checkpoint_s=round(t_ckpt, 3), criu_dump_s=round(t_dump, 3),
        gpu_restore_after_dump_s=round(t_release, 3), stall_s=round(stall, 3),
        capture_gbps=round(gpu_bytes / t_ckpt / 1e9, 2) if t_ckpt > 0 else None,
    )
    if dump_error is not None:
        res.update(criu_dump_error=dump_error, thaw_identical=False)
        return res

    thaw = Job(work, f"{name}-thaw", nproc, args)
    try:
        mapping = stage.plan(recorded)
        t3 = time.monotonic()
        thaw.restore(images, inodes, inits)
        t_criu_restore = time.monotonic() - t3
        if fake is not None:  # restored from an image: CUDA state CHECKPOINTED
            from snapshotter.gpu.stage import sandbox_pids

            for sb in thaw.sandboxes:
                fake.add_process(sandbox_pids(sb.pid)[0],
                                 state=fake.CUprocessState.CU_PROCESS_STATE_CHECKPOINTED)
        t4 = time.monotonic()
        stage.thaw({r: sb.pid for r, sb in enumerate(thaw.sandboxes)}, recorded, mapping)
        t_gpu_restore = time.monotonic() - t4
        thaw.resume(f"t{uuid.uuid4().hex[:8]}", thaw.store)
        thawed = thaw.results()
    finally:
        thaw.close()
    res.update(
        thaw_identical=[r["digest"] for r in thawed] == [r["digest"] for r in reference],
        criu_restore_s=round(t_criu_restore, 3), gpu_restore_s=round(t_gpu_restore, 3),
        restore_gbps=round(gpu_bytes / t_gpu_restore / 1e9, 2) if t_gpu_restore > 0 else None,
    )
    return res


def migrate_case(a: argparse.Namespace, stage: GpuStage, fake: Any, work: Path) -> dict[str, Any]:
    """Rank 1 of a 2-rank gloo job on one GPU moves to a new sandbox, rank 0 stays."""
    from snapshotter.agent import handoff
    from snapshotter.gpu.stage import sandbox_pids

    args = ["--steps", str(a.steps), "--device", a.device, "--width", str(a.width),
            "--layers", str(a.layers), "--step-sleep", str(a.step_sleep), "--backend", "gloo"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "SNAPSHOTTER_HOLD_S": "120"}
    res: dict[str, Any] = {"case": "migrate", "nproc": 2}
    ref = Job(work, "migrate-ref", 2, args)
    try:
        ref.start(env)
        reference = ref.results()
    finally:
        ref.close()
    job = Job(work, "migrate-live", 2, args)
    try:
        job.start(env)
        job.wait_step(a.freeze_at)
        if fake is not None:
            for sb in job.sandboxes:
                fake.add_process(sandbox_pids(sb.pid)[0])
        fid = f"m{uuid.uuid4().hex[:8]}"
        t_park = time.monotonic()
        job.quiesce(fid)
        src = job.sandboxes[1]
        hold = stage.freeze({1: src.pid})
        images = work / "migrate-images" / "rank-1"
        criu.dump(src.pid, images, leave_running=True, log_dir=work / "criu-logs" / "mig-dump")
        t_dump = time.monotonic() - t_park
        t0 = time.monotonic()
        moved = work / "migrate-received" / "rank-1"
        size = handoff.receive(handoff.pieces(images), moved, lambda n: None)
        t_transfer = time.monotonic() - t0
        recorded = {r: rg.gpus for r, rg in hold.ranks.items()}
        gpu_bytes = hold.state_bytes()
        src.kill()  # the source's copy ends; its GPU state stays checkpointed with it
        src.wait(30)
        mapping = stage.plan(recorded)
        Path(job.inits[1]).mkdir(parents=True, exist_ok=True)
        t1 = time.monotonic()
        sb = criu.restore(moved, dict(src.io.inodes), log_dir=work / "criu-logs" / "mig-restore")
        if fake is not None:
            fake.add_process(sandbox_pids(sb.pid)[0],
                             state=fake.CUprocessState.CU_PROCESS_STATE_CHECKPOINTED)
        stage.thaw({1: sb.pid}, recorded, mapping)
        t_restore = time.monotonic() - t1
        ch, pump = job.channels[1], job.pumps[1]
        job.sandboxes, job.channels, job.pumps = job.sandboxes[:1], job.channels[:1], job.pumps[:1]
        job._attach(1, sb)
        ch.close()
        pump.join(timeout=5)
        job.resume(fid, job.store)  # rank 0 never left memory; both rebuild under one epoch
        downtime = time.monotonic() - t_park
        live = job.results()
    finally:
        job.close()
    res.update(
        identical=[r["digest"] for r in live] == [r["digest"] for r in reference],
        gpu_state_bytes=gpu_bytes, image_bytes=size, dump_s=round(t_dump, 3),
        transfer_s=round(t_transfer, 3), restore_s=round(t_restore, 3),
        downtime_s=round(downtime, 3),
    )
    return res


def steptime_case(a: argparse.Namespace, work: Path, pairs: int) -> dict[str, Any]:
    """Median step time of one DDP rank with small buckets, plain vs under the hook."""
    import socket
    import statistics
    import subprocess

    work.mkdir(parents=True, exist_ok=True)
    args = ["--mode", "ddp", "--bucket-mb", "0.05", "--device", a.device, "--steps", "200",
            "--width", str(min(a.width, 1024)), "--layers", "12"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

    def plain() -> float:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        e = {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        p = subprocess.run([sys.executable, str(HOOK_JOB), *args], env=e, capture_output=True,
                           text=True, timeout=300, check=True)  # fmt: skip
        found = re.findall(r"^RESULT (.*)$", p.stdout, re.M)
        return float(json.JSONDecoder().raw_decode(found[-1])[0]["median_step_ms"])

    def hooked(i: int) -> tuple[float, Any]:
        job = Job(work, f"steptime-{i}", 1, args, script=HOOK_JOB)
        try:
            job.start(env)
            r = job.results()[0]
            return float(r["median_step_ms"]), r.get("collectives_per_step")
        finally:
            job.close()

    runs: list[tuple[float, float]] = []
    per_step = None
    for i in range(pairs):
        if i % 2 == 0:
            p = plain()
            h, per_step = hooked(i)
        else:
            h, per_step = hooked(i)
            p = plain()
        runs.append((p, h))
    ratios = [h / p for p, h in runs]
    return {"case": "steptime", "collectives_per_step": per_step,
            "plain_ms": round(statistics.median(p for p, _ in runs), 3),
            "hooked_ms": round(statistics.median(h for _, h in runs), 3),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", choices=["cuda", "fake"], default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--case", choices=["single", "nccl", "gloo2", "migrate", "steptime", "all"],
                    default="all")  # fmt: skip
    ap.add_argument("--steptime-pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--freeze-at", type=int, default=20)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--work", type=Path, default=Path("/tmp/snapshotter-gpu-check"))
    a = ap.parse_args()
    become_subreaper()
    criu.criu_binary()  # fail early, with the install hint, when CRIU is not there
    fake = None
    if a.driver == "fake":
        from snapshotter.testing.gpu_fake import FakeCudaDriver

        fake = FakeCudaDriver()
        driver: CudaDriver | None = CudaDriver(fake)
    else:
        driver = detect()
        if driver is None:
            out(error="no usable NVIDIA driver / checkpoint API on this machine (see log)")
            return 2
        out(gpus=[g.to_dict() for g in driver.gpus()])
    assert driver is not None
    stage = GpuStage(driver, GpuStageSettings(lock_timeout_s=30, op_timeout_s=300))
    shutil.rmtree(a.work, ignore_errors=True)  # logs are appended: start from nothing
    a.work.mkdir(parents=True, exist_ok=True)
    ok = True
    cases: tuple[tuple[str, int, list[str]], ...] = (
        ("single", 1, []), ("nccl", 1, ["--dist", "--backend", "nccl"]),
        ("gloo2", 2, ["--backend", "gloo"]))
    for name, nproc, extra in cases:
        if a.case not in (name, "all"):
            continue
        t0 = time.monotonic()
        try:
            r = case(name, nproc, extra, a, stage, fake, a.work / name)
        except Exception as e:  # noqa: BLE001 - one case failing must not hide the other
            out(case=name, error=f"{type(e).__name__}: {e}"[-4000:])
            ok = False
            continue
        r["wall_s"] = round(time.monotonic() - t0, 1)
        out(**r)
        ok = ok and r["freeze_continue_identical"] and r["thaw_identical"] and r["telemetry_ok"]
    if a.case in ("migrate", "all"):
        t0 = time.monotonic()
        try:
            r = migrate_case(a, stage, fake, a.work / "migrate")
            r["wall_s"] = round(time.monotonic() - t0, 1)
            out(**r)
            ok = ok and r["identical"]
        except Exception as e:  # noqa: BLE001 - reported, the other cases still count
            out(case="migrate", error=f"{type(e).__name__}: {e}"[-4000:])
            ok = False
    if a.case in ("steptime", "all"):
        t0 = time.monotonic()
        try:  # a measurement, not a pass/fail check
            r = steptime_case(a, a.work / "steptime", a.steptime_pairs)
            r["wall_s"] = round(time.monotonic() - t0, 1)
            out(**r)
        except Exception as e:  # noqa: BLE001 - reported, the other cases still count
            out(case="steptime", error=f"{type(e).__name__}: {e}"[-4000:])
    out(summary="PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
