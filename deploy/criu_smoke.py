#!/usr/bin/env python3
"""Smoke test: pycriu drives the installed criu binary (run by deploy/install-criu.sh --smoke).

Starts `sleep 1000` in its own session (setsid), dumps it with pycriu through
`criu.use_binary(<wrapper>)` leaving it running, decodes the images with pycriu.images
(exercises the *_pb2 modules against the installed protobuf), then kills the sleep it started.
With --restore it also kills the original and restores it from the images, then kills the
restored one (same pid, checked to still be our `sleep`).
Exit status 0 on success. Needs root.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pycriu


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().split(b"\0")[:2]
    except OSError:
        return None


def kill_ours(pid, marker):
    """Kill pid only if it is still the process we started (its cmdline is our marker)."""
    if cmdline(pid) == marker:
        os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if cmdline(pid) != marker:
            return
        time.sleep(0.05)


def tail(path, n=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return "(no log: %s)" % e


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--criu", default="/opt/snapshotter/criu/bin/criu")
    ap.add_argument("--restore", action="store_true", help="also restore from the images")
    ap.add_argument("--keep", action="store_true", help="keep the images directory")
    args = ap.parse_args()

    imgdir = tempfile.mkdtemp(prefix="criu-smoke-")
    marker = [b"sleep", b"1000"]
    # start_new_session=True: the child calls setsid() before exec, i.e. `setsid sleep 1000`
    # without setsid(1)'s possible extra fork, so p.pid is the sleep itself.
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    pid = p.pid
    ok = False
    dirfd = os.open(imgdir, os.O_DIRECTORY)
    try:
        time.sleep(0.2)
        c = pycriu.criu()
        c.use_binary(args.criu)
        c.opts.images_dir_fd = dirfd
        c.opts.pid = pid
        c.opts.shell_job = False
        c.opts.leave_running = True
        c.opts.log_file = "dump.log"
        c.opts.log_level = 4
        t0 = time.monotonic()
        try:
            c.dump()
        except pycriu.CRIUException as e:
            print("dump FAILED: %s\n--- dump.log tail ---\n%s" % (e, tail(os.path.join(imgdir, "dump.log"))))
            return 1
        print("dump of pid %d OK in %.2fs (%s)" % (pid, time.monotonic() - t0, imgdir))
        if p.poll() is not None or cmdline(pid) != marker:
            print("FAILED: the dumped process did not keep running (leave_running)")
            return 1
        print("process %d still running after dump (leave_running=True)" % pid)

        # decode images with pycriu.images (pb2dict + *_pb2 under the installed protobuf)
        with open(os.path.join(imgdir, "pstree.img"), "rb") as f:
            pstree = pycriu.images.load(f)
        root_pid = pstree["entries"][0]["pid"]
        with open(os.path.join(imgdir, "core-%d.img" % pid), "rb") as f:
            core = pycriu.images.load(f)
        comm = core["entries"][0]["tc"]["comm"]
        n_imgs = 0
        for name in sorted(os.listdir(imgdir)):
            if name.endswith(".img") and not name.startswith("pages-"):
                with open(os.path.join(imgdir, name), "rb") as f:
                    pycriu.images.load(f)
                n_imgs += 1
        print("decoded %d images with pycriu.images: pstree root pid %s, comm %r"
              % (n_imgs, root_pid, comm))
        if root_pid != pid or comm != "sleep":
            print("FAILED: images do not describe the dumped sleep")
            return 1

        if args.restore:
            kill_ours(pid, marker)
            p.wait()
            r = pycriu.criu()
            r.use_binary(args.criu)
            r.opts.images_dir_fd = dirfd
            r.opts.shell_job = False
            r.opts.log_file = "restore.log"
            r.opts.log_level = 4
            try:
                resp = r.restore()
            except pycriu.CRIUException as e:
                print("restore FAILED: %s\n--- restore.log tail ---\n%s"
                      % (e, tail(os.path.join(imgdir, "restore.log"))))
                return 1
            print("restore OK: pid %d, cmdline %r" % (resp.pid, cmdline(resp.pid)))
            if resp.pid != pid or cmdline(pid) != marker:
                print("FAILED: restored process is not our sleep")
                return 1
        ok = True
        print("pycriu smoke test: OK")
        return 0
    finally:
        os.close(dirfd)
        kill_ours(pid, marker)          # only the pid this script started (or restored)
        if p.returncode is None:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if ok and not args.keep:
            shutil.rmtree(imgdir, ignore_errors=True)
        else:
            print("images and logs kept in %s" % imgdir)


if __name__ == "__main__":
    sys.exit(main())
