"""Nodes for real on one machine: each node is a Linux network namespace on a private bridge.

`Cluster(["ctl", "a", "b"])` creates, per node, a namespace `sn<tag>-<node>` holding `lo` (up:
CRIU needs it) and one end of a veth pair, renamed per node (`e<tag>n<i>`: a rank restored on
another node must pick up that node's interface name, so every node's name differs on purpose).
The other ends sit on one bridge `snb<tag>` in the root namespace. Node i gets 10.213.k.(i+1)/24
and the bridge 10.213.k.254, so the test process reaches every node and every node reaches
servers the test binds on `cluster.host_ip` (the S3 server). No namespace has a default route:
nothing a node does leaves the machine, and a node cannot reach the root namespace's
127.0.0.1.

`node.popen(argv)` enters only the node's network namespace (`nsenter --net`), never a new mount
namespace (`ip netns exec` makes one, and CRIU cannot dump a process that sits in it).

It must never touch a namespace, link or process it did not create. Every name is planned up
front and written to /run/snapshotter-test-netns/<tag> (with the creator's pid and start time)
before anything is made, so `close()` and, for a run that crashed, `sweep_stale()` delete
exactly those names, and kill only processes that live inside those namespaces.

From a test:

    from tests.support.netns import netns_cluster  # noqa: F401  (a pytest fixture)

    def test_x(netns_cluster):
        cluster = netns_cluster(["ctl", "a", "b"])
        proc = cluster["a"].popen([sys.executable, "-m", "http.server", "--bind",
                                   cluster["a"].ip], env={**os.environ,
                                   **cluster["a"].network_env()})

From a bench script (after `sys.path.insert(0, repo_root)`):

    from tests.support.netns import Cluster
    with Cluster(["a", "b"]) as cluster:
        ...
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

STATE_DIR = Path("/run/snapshotter-test-netns")
PREFIX = "sn"
NETNS_DIR = Path("/run/netns")
# 10.213.k.0/24 for some free k; the second octet only makes a clash with real networks unlikely,
# the route check in _pick_subnet makes it impossible.
SUPERNET = ipaddress.IPv4Network("10.213.0.0/16")
HOST_OCTET = 254
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_IFNAMSIZ = 15


class NetnsError(RuntimeError):
    """A namespace, link or address could not be created or removed; the message has the
    failing `ip` command and its stderr. `permission` is set when the kernel said EPERM."""

    def __init__(self, message: str, permission: bool = False) -> None:
        super().__init__(message)
        self.permission = permission


# -- small helpers ------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        err = proc.stderr.strip()
        raise NetnsError(
            f"ip {' '.join(args)} failed ({proc.returncode}): {err}",
            permission="Operation not permitted" in err,
        )
    return proc


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/pid/stat): a pid plus its start
    time names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def _alive(pid: int, start_time: str | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def _ns_id(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in_netns(ns_path: str | Path) -> list[int]:
    """Every live process whose network namespace is the one bound at `ns_path`."""
    target = _ns_id(ns_path)
    if target is None:
        return []
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and _ns_id(f"/proc/{entry}/ns/net") == target:
            pids.append(int(entry))
    return pids


def _kill_netns_processes(ns_path: str | Path, timeout_s: float = 10.0) -> None:
    """SIGKILL everything inside the namespace, again until nothing is left: a process may
    fork while we scan, and CRIU-restored or daemonized ones are in no group we know.

    Raises:
        NetnsError: something is still inside after `timeout_s` (stuck in the kernel).
    """
    deadline = time.monotonic() + timeout_s
    while pids := _pids_in_netns(ns_path):
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in {ns_path} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """Serializes subnet choice and sweeping between harness users on this machine."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _used_networks() -> list[ipaddress.IPv4Network]:
    used = []
    for line in _ip("-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        for token in line.split()[:2]:  # "10.0.0.0/8 dev ..." or "local 127.0.0.1 dev ..."
            with contextlib.suppress(ValueError):
                used.append(ipaddress.IPv4Network(token, strict=False))
                break
    return used


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    subnets = list(SUPERNET.subnets(new_prefix=24))
    start = secrets.randbelow(len(subnets))
    for net in subnets[start:] + subnets[:start]:
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError(f"no free /24 in {SUPERNET}: every one overlaps a route")


# -- leftovers of crashed runs ------------------------------------------------------------


def _remove(netns: Sequence[str], links: Sequence[str], prefix: str = PREFIX) -> None:
    """Delete the named namespaces (killing what runs inside first) and links, if present,
    carrying on past failures so one stuck piece does not leak the rest.
    Links go first: deleting a veth end removes its peer at once, while a namespace's own
    links vanish only when the kernel gets round to destroying it.

    Raises:
        NetnsError: the first step that failed, after every other step was tried.
    """
    errors: list[NetnsError] = []

    def attempt(fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        except NetnsError as e:
            errors.append(e)

    ours_ns = [n for n in netns if n.startswith(prefix)]
    for ns in ours_ns:
        attempt(_kill_netns_processes, NETNS_DIR / ns)
    for link in links:
        if link.startswith(prefix) and _link_exists(link):
            attempt(_ip, "link", "del", link)
    for ns in ours_ns:
        if (NETNS_DIR / ns).exists():
            attempt(_ip, "netns", "del", ns)
    if errors:
        raise errors[0]


def sweep_stale(prefix: str = PREFIX, state_dir: Path = STATE_DIR) -> list[str]:
    """Remove what earlier runs recorded in `state_dir` and left behind because their process
    died (pid gone, or reused by another process). Only names the record lists and that start
    with `prefix` are touched; live runs' records are left alone. Returns the removed names."""
    removed: list[str] = []
    if not state_dir.is_dir():
        return removed
    for record in sorted(state_dir.iterdir()):
        if record.name.startswith("."):
            continue
        try:
            state = json.loads(record.read_text())
            if _alive(int(state["pid"]), state.get("start_time")):
                continue
            netns = [str(n) for n in state.get("netns", []) if (NETNS_DIR / str(n)).exists()]
            links = [str(n) for n in state.get("links", []) if _link_exists(str(n))]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record we can read: leave it and whatever it names alone
        try:
            _remove(netns, links, prefix)
        except NetnsError:
            continue  # keep the record: a later sweep tries again
        removed += netns + links
        record.unlink(missing_ok=True)
    return removed


# -- the cluster --------------------------------------------------------------------------


class Node:
    """One node: a network namespace with one interface on the cluster's bridge."""

    def __init__(self, cluster: Cluster, name: str, netns: str, ip: str, ifname: str) -> None:
        self.cluster = cluster
        self.name = name
        self.netns = netns
        self.netns_path = str(NETNS_DIR / netns)
        self.ip = ip
        self.ifname = ifname
        # Data links (Cluster(..., data_links=K)): interface, address and the root-namespace
        # end of the veth, per plane.
        self.links: list[str] = []
        self.link_ips: list[str] = []
        self.link_host_ends: list[str] = []

    def set_link(self, plane: int, up: bool, side: str = "host") -> None:
        """Take data link `plane` down or up: on the bridge's side (the cable: the node sees
        its carrier go) or on the node's own interface (`ip link set IFACE down` there)."""
        state = "up" if up else "down"
        if side == "host":
            _ip("link", "set", self.link_host_ends[plane], state)
        else:
            _ip("-n", self.netns, "link", "set", self.links[plane], state)

    def block_link(self, plane: int, blocked: bool) -> None:
        """Make the bridge drop (or forward again) everything on data link `plane` while
        the link stays up on both ends: a switch port that fails silently."""
        state = "0" if blocked else "3"  # disabled / forwarding
        subprocess.run(["bridge", "link", "set", "dev", self.link_host_ends[plane], "state",
                        state], check=True, capture_output=True, timeout=30)  # fmt: skip

    def __repr__(self) -> str:
        return f"Node({self.name!r}, netns={self.netns!r}, ip={self.ip!r}, if={self.ifname!r})"

    def network_env(self) -> dict[str, str]:
        """What a rank on this node needs to bind its collectives to this node's interface."""
        return {
            "GLOO_SOCKET_IFNAME": self.ifname,
            "NCCL_SOCKET_IFNAME": self.ifname,
            "TP_SOCKET_IFNAME": self.ifname,
        }

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` as a command line that runs it in this node's network namespace only.
        nsenter execs `argv` in place (no fork), so the pid started is argv's own."""
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]

    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in this node; `Cluster.close()` kills and reaps it. It gets its own
        session (process group) unless `start_new_session=False` is given."""
        popen_kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(self.wrap(argv), **popen_kwargs)
        self.cluster._track(proc, popen_kwargs["start_new_session"])
        return proc

    def run(self, argv: Sequence[str], **run_kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run in this node (timeout 60 s unless given)."""
        run_kwargs.setdefault("timeout", 60)
        return subprocess.run(self.wrap(argv), **run_kwargs)


class Cluster:
    """N nodes on one bridge, created on construction; a context manager. `close()` kills
    every process inside the nodes and deletes every namespace, veth and the bridge; it is
    idempotent and also runs at interpreter exit. A failure half-way through construction
    rolls back what was made before the exception propagates.

    Raises:
        ValueError: a node name is invalid or repeated.
        NetnsError: `ip` failed (with `permission=True` when not allowed to make namespaces).
    """

    def __init__(self, names: Sequence[str], data_links: int = 0) -> None:
        """`data_links`: K more interfaces per node, plane j on its own bridge and subnet
        (the management interface above stays on the first bridge)."""
        names = list(names)
        if not 0 <= data_links <= 4:
            raise ValueError(f"data_links must be 0..4, got {data_links}")
        self.data_links = data_links
        if not names or len(names) > HOST_OCTET - 1:
            raise ValueError(f"need 1..{HOST_OCTET - 1} node names, got {len(names)}")
        for n in names:
            if not _NODE_NAME.match(n):
                raise ValueError(f"node name {n!r}: use letters, digits, '_', '.', '-'")
        if len(set(names)) != len(names):
            raise ValueError(f"node names repeat: {names}")
        self.tag = secrets.token_hex(3)
        self.bridge = f"{PREFIX}b{self.tag}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.host_ip = ""
        self.nodes: dict[str, Node] = {}
        self._host_ends = [f"{PREFIX}v{self.tag}n{i}" for i in range(len(names))]
        self._data_bridges = [f"{PREFIX}b{self.tag}d{j}" for j in range(data_links)]
        self._data_ends = [
            f"{PREFIX}v{self.tag}n{i}d{j}" for i in range(len(names)) for j in range(data_links)
        ]
        self.data_subnets: list[ipaddress.IPv4Network] = []
        self._names = names
        self._procs: list[tuple[subprocess.Popen[Any], bool]] = []
        self._record = STATE_DIR / self.tag
        self._closed = False
        assert len(self.bridge) <= _IFNAMSIZ and len(self._host_ends[-1]) <= _IFNAMSIZ
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __repr__(self) -> str:
        return f"Cluster(tag={self.tag!r}, subnet={self.subnet}, nodes={list(self.nodes)})"

    @property
    def netns_names(self) -> list[str]:
        return [f"{PREFIX}{self.tag}-{n}" for n in self._names]

    @property
    def link_names(self) -> list[str]:
        """The links this cluster makes in the root namespace: host veth ends, then bridge."""
        return [*self._host_ends, *self._data_ends, self.bridge, *self._data_bridges]

    # -- setup ----------------------------------------------------------------------------

    def _create(self) -> None:
        with _state_lock():
            sweep_stale()
            # Recorded before anything exists, so a crash at any point leaves a record.
            self._record.write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "start_time": _start_time(os.getpid()),
                        "netns": self.netns_names,
                        "links": self.link_names,
                    }
                )
            )
            self.subnet = _pick_subnet()
            self.host_ip = str(self.subnet[HOST_OCTET])
            _ip("link", "add", self.bridge, "type", "bridge")
            # The address claims the subnet (its route appears) before the lock is released.
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            for br in self._data_bridges:
                net = _pick_subnet()
                _ip("link", "add", br, "type", "bridge")
                # Claims the subnet; the root namespace reaches nodes on no data plane
                # otherwise (its address is never used).
                _ip("addr", "add", f"{net[HOST_OCTET]}/24", "dev", br)
                self.data_subnets.append(net)
        _ip("link", "set", self.bridge, "up")
        for br in self._data_bridges:
            _ip("link", "set", br, "up")
        for i, name in enumerate(self._names):
            self._add_node(i, name)

    def _add_node(self, i: int, name: str) -> None:
        assert self.subnet is not None
        netns, host_end = self.netns_names[i], self._host_ends[i]
        ifname = f"e{self.tag}n{i}"
        ip = str(self.subnet[i + 1])
        _ip("netns", "add", netns)
        # The peer is born inside the namespace under its per-node name: it never exists in
        # the root namespace, so there is nothing to rename or leak there.
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ifname, "netns", netns)
        _ip("link", "set", host_end, "master", self.bridge, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "addr", "add", f"{ip}/24", "dev", ifname)
        _ip("-n", netns, "link", "set", ifname, "up")
        node = Node(self, name, netns, ip, ifname)
        for j, (br, net) in enumerate(zip(self._data_bridges, self.data_subnets, strict=True)):
            end, dif, dip = f"{host_end}d{j}", f"{ifname}d{j}", str(net[i + 1])
            _ip("link", "add", end, "type", "veth", "peer", "name", dif, "netns", netns)
            _ip("link", "set", end, "master", br, "up")
            _ip("-n", netns, "addr", "add", f"{dip}/24", "dev", dif)
            _ip("-n", netns, "link", "set", dif, "up")
            node.links.append(dif)
            node.link_ips.append(dip)
            node.link_host_ends.append(end)
        self.nodes[name] = node

    # -- processes and teardown -----------------------------------------------------------

    def _track(self, proc: subprocess.Popen[Any], own_group: bool) -> None:
        self._procs.append((proc, own_group))

    @property
    def processes(self) -> list[subprocess.Popen[Any]]:
        """Every process started by `Node.popen`."""
        return [p for p, _ in self._procs]

    def kill_processes(self) -> None:
        """SIGKILL every process started in a node (their groups too) and every other process
        still inside a node's namespace, then reap the ones we started."""
        for proc, own_group in self._procs:
            # returncode None: not reaped yet, so the pid (and group id) cannot be reused.
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    if own_group:
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
        for ns in self.netns_names:
            _kill_netns_processes(NETNS_DIR / ns)
        for proc, _ in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self._procs = []

    def close(self) -> None:
        """Kill the nodes' processes and delete namespaces, veths and bridge. Idempotent."""
        if self._closed:
            return
        self.nodes = {}
        try:
            self.kill_processes()
        finally:
            _remove(self.netns_names, self.link_names)
        # Only once all is gone: after a failure the record stays for sweep_stale, and close
        # stays registered to try again at exit.
        self._record.unlink(missing_ok=True)
        self._closed = True
        atexit.unregister(self.close)


# -- pytest -------------------------------------------------------------------------------


def netns_unavailable() -> str | None:
    """Why this machine cannot make test namespaces, or None if it can (as far as we can tell
    without trying)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install iproute2 util-linux)"
    return None


@pytest.fixture()
def netns_cluster() -> Iterator[Callable[..., Cluster]]:
    """`netns_cluster(["ctl", "a", "b"])` -> a Cluster, closed at teardown (pass or fail).
    Skips when not root, `ip`/`nsenter` are missing, or the kernel refuses a namespace."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Cluster] = []

    def make(names: Sequence[str], data_links: int = 0) -> Cluster:
        try:
            cluster = Cluster(names, data_links)
        except NetnsError as e:
            if e.permission:
                pytest.skip(f"cannot create network namespaces: {e}")
            raise
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        errors = []
        for cluster in made:
            try:
                cluster.close()
            except Exception as e:  # noqa: BLE001 - close every cluster, report the first
                errors.append(e)
        if errors:
            raise errors[0]
