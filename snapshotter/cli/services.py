"""`snapshotter coordinator`, `agent`, `certs` and `token`: serving and securing a cluster.

    snapshotter certs init DIR --nodes a,b            a CA and certificates (rpc/tls.py)
    snapshotter coordinator --listen IP:7070 --tls-dir DIR --store s3://...
    snapshotter agent --listen IP:7071 --coordinator COORD:7070 --name a --tls-dir DIR \\
        --allow-cwd /srv/jobs
    snapshotter token create --file F --name alice --role operator [--ttl 30d]

Services listen on loopback unless told otherwise, and never beyond it without TLS: see
snapshotter/rpc/server.py for the policy and rpc/auth.py for roles and rights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapshotter import errors, servicelog
from snapshotter.agent.allow import ExecPolicy
from snapshotter.config import Paths, default_home, encrypt_at_rest, store_url
from snapshotter.rpc.auth import Role, TokenStore
from snapshotter.rpc.client import Target
from snapshotter.rpc.tls import COORDINATOR_NAME, init_ca, tls_files
from snapshotter.storage.format import validate_name

if TYPE_CHECKING:
    from snapshotter.rpc.server import Listen

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(v: str) -> float:
    m = _DURATION.match(v.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{v!r} is not a duration like 90s, 30m, 12h or 30d")
    return float(m.group(1)) * _UNIT[m.group(2)]


def _metrics_arg(p: argparse.ArgumentParser, port: str) -> None:
    p.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                   help=f"serve Prometheus metrics at /metrics (e.g. 127.0.0.1:{port}; beyond "
                   "loopback over HTTPS to clients with a certificate of the --tls-dir CA)")


def _tls_args(p: argparse.ArgumentParser, who: str) -> None:
    g = p.add_argument_group("TLS (mutual) and tokens")
    g.add_argument("--tls-dir", default=None,
                   help=f"a directory from `snapshotter certs init` ({who} presents its own "
                        "certificate from it)")  # fmt: skip
    g.add_argument("--tls-ca", default=None, help="CA certificate (an existing PKI)")
    g.add_argument("--tls-cert", default=None, help="this service's certificate")
    g.add_argument("--tls-key", default=None, help="this service's key")
    g.add_argument("--tokens", default=None, metavar="FILE",
                   help="bearer tokens this service accepts (`snapshotter token create`)")
    g.add_argument("--insecure", action="store_true",
                   help="no TLS and no authentication, on any address: for tests only")


def _log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=servicelog.FORMATS, default=None,
                   help="text lines (default) or one JSON object per line "
                   "($SNAPSHOTTER_LOG_FORMAT)")  # fmt: skip
    p.add_argument("--log-level", choices=servicelog.LEVELS, default=None,
                   help="the least severe records logged (default info; $SNAPSHOTTER_LOG_LEVEL)")


def _logging(a: argparse.Namespace) -> None:
    """The flags' choice into the environment the service and the processes it starts (the
    agent under its keeper) read."""
    if a.log_format:
        os.environ["SNAPSHOTTER_LOG_FORMAT"] = a.log_format
    if a.log_level:
        os.environ["SNAPSHOTTER_LOG_LEVEL"] = a.log_level
    servicelog.setup()


def _token(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read token file {path}: {e.strerror}",
                                     "point it at a file holding one token") from e  # fmt: skip


def _listen(a: argparse.Namespace, tls_name: str) -> Listen:
    # Here, not at the top: the server's imports (metrics, asyncio) would cost every CLI call.
    from snapshotter.rpc.server import Listen

    return Listen(
        a.listen,
        tls=tls_files(a.tls_dir, tls_name, a.tls_ca, a.tls_cert, a.tls_key),
        tokens=TokenStore(Path(a.tokens)) if a.tokens else None,
        insecure=a.insecure,
    )


def cmd_coordinator(a: argparse.Namespace) -> int:
    from snapshotter import daemon

    _logging(a)
    daemon.bound_malloc()
    listen = _listen(a, COORDINATOR_NAME)
    cfg = daemon.CoordinatorConfig(
        listen=listen,
        store_url=a.store or store_url(Paths(default_home())),
        agent_tls=listen.tls,  # its own certificate (OU=coordinator) toward the agents
        agent_token=_token(a.agent_token_file),
        agent_ttl=a.agent_ttl,
        max_heartbeats_per_s=a.max_heartbeats,
        keys_dir=Paths(default_home()).keys_dir,
        encrypt=encrypt_at_rest() and not a.no_encrypt,
        audit_log=Paths(default_home()).audit_log,
        tenants_file=Paths(default_home()).tenants_file,
        webhooks_file=Paths(default_home()).webhooks_file,
        metrics_listen=a.metrics_listen,
    )
    return daemon.serve_coordinator(cfg)


def _under_keeper(paths: Paths) -> None:
    """Become a keeper that runs this same agent command (exec: the service manager's main
    process stays this pid), so that an agent crash or upgrade never costs a job its ranks.

    Raises: ServiceUnavailable if another agent's keeper already serves this home.
    """
    from snapshotter import keeper

    if keeper.alive(paths.keeper_socket):
        raise errors.ServiceUnavailable(
            f"an agent already runs with this SNAPSHOTTER_HOME (its keeper answers at "
            f"{paths.keeper_socket})",
            "stop it first (SIGTERM drains its jobs; SIGHUP restarts it and keeps them), "
            "or give this agent its own SNAPSHOTTER_HOME",
        )
    paths.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    argv = keeper.command(paths.keeper_socket, [sys.executable, "-m", "snapshotter",
                                                *sys.argv[1:]])  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def cmd_agent(a: argparse.Namespace) -> int:
    from snapshotter import daemon
    from snapshotter.keeper import ENV as KEEPER_ENV

    paths = Paths(default_home())
    if a.keeper and not os.environ.get(KEEPER_ENV) and "agent" in sys.argv[1:]:
        _logging(a)  # the keeper logs as the agent does
        _under_keeper(paths)
    _logging(a)
    daemon.bound_malloc()
    name = a.name or socket.gethostname()
    listen = _listen(a, f"nodes/{name}")
    env: dict[str, str] = {}
    for kv in a.env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise errors.InvalidArgument(f"--env {kv!r} is not KEY=VALUE", "fix the flag")
        env[k] = v
    coordinator = Target(
        a.coordinator,
        tls=listen.tls,
        server_name=COORDINATOR_NAME,
        token=_token(a.token_file),
    )
    cfg = daemon.AgentConfig(
        paths=paths,
        listen=listen,
        coordinator=coordinator,
        name=name,
        store_url=a.store or store_url(paths),
        env_overrides=env,
        links=tuple(x for v in a.link for x in v.split(",") if x),
        heartbeat_s=a.heartbeat,
        freeze_lease_s=a.freeze_lease,
        policy=ExecPolicy.default(a.allow_python, a.allow_cwd),
        metrics_listen=a.metrics_listen,
    )
    return daemon.serve_agent(cfg)


def cmd_certs_init(a: argparse.Namespace) -> int:
    nodes = [n for n in a.nodes.split(",") if n]
    clients = []
    for c in a.client or ["admin:admin"]:
        name, _, role = c.partition(":")
        try:
            clients.append((name, Role(role or name).value))
        except ValueError as e:
            raise errors.InvalidArgument(
                f"--client {c!r}: unknown role", f"roles: {', '.join(r.value for r in Role)}"
            ) from e
    node_sans = []
    for s in a.node_san:
        n, sep, v = s.partition("=")
        if not sep:
            raise errors.InvalidArgument(f"--node-san {s!r} is not NODE=NAME_OR_IP", "fix it")
        node_sans.append((n, v))
    written = init_ca(Path(a.dir), nodes, clients, a.san, node_sans)
    for p in written:
        print(p)
    print(
        f"made a CA and certificates for the coordinator, {len(nodes)} node(s) and "
        f"{len(clients)} client(s) in {a.dir}; keep {a.dir}/ca.key offline",
        file=sys.stderr,
    )
    return 0


def cmd_token(a: argparse.Namespace) -> int:
    store = TokenStore(Path(a.file))
    if a.token_cmd == "create":
        if a.tenant is not None:
            try:
                validate_name(a.tenant, "tenant")
            except ValueError as e:
                raise errors.InvalidArgument(str(e), "fix --tenant") from e
        token = store.create(a.name, Role(a.role), a.ttl, tenant=a.tenant)
        scope = f", tenant {a.tenant}" if a.tenant else ""
        print(f"token for {a.name} ({a.role}{scope}); it is shown only now:", file=sys.stderr)
        print(token)
    elif a.token_cmd == "revoke":
        if not store.revoke(a.id):
            raise errors.InvalidArgument(f"no token with id {a.id!r} in {a.file}",
                                         f"`snapshotter token list --file {a.file}`")  # fmt: skip
        print(f"revoked {a.id}")
    else:
        rows: list[dict[str, Any]] = store.list()
        print(json.dumps({"tokens": rows}) if a.json else
              "\n".join(f"{t['id']}  {t['name']}  {t['role']}  "
                        f"tenant {t.get('tenant') or '(all)'}  expires "
                        f"{t['expires'] or 'never'}" for t in rows) or "no tokens")  # fmt: skip
    return 0


def cmd_gateway(a: argparse.Namespace) -> int:
    from snapshotter.gateway.serve import Gateway, GatewayConfig

    _logging(a)
    cfg = GatewayConfig(
        listen=a.listen, coordinator=a.coordinator,
        coordinator_tls=tls_files(a.tls_dir, a.tls_name, a.tls_ca, a.tls_cert, a.tls_key),
        https_cert=Path(a.https_cert) if a.https_cert else None,
        https_key=Path(a.https_key) if a.https_key else None,
    )  # fmt: skip
    gw = Gateway(cfg)
    print(json.dumps({"gateway": gw.address, "coordinator": a.coordinator}), flush=True)
    gw.run()
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    gw = sub.add_parser("gateway", parents=[common],
                        help="serve the provider HTTP/JSON API before a coordinator")  # fmt: skip
    gw.set_defaults(fn=cmd_gateway)
    gw.add_argument("--listen", default="127.0.0.1:8080",
                    help="host:port (beyond loopback only with --https-cert, --https-key)")
    gw.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    gw.add_argument("--https-cert", default=None, help="the API's HTTPS certificate (PEM)")
    gw.add_argument("--https-key", default=None, help="its key (PEM)")
    _log_args(gw)
    g = gw.add_argument_group("TLS toward the coordinator (a `client` certificate)")
    g.add_argument("--tls-dir", default=None, help="a directory made by `snapshotter certs init`")
    g.add_argument("--tls-name", default="clients/gateway",
                   help="its certificate there (made with `certs init --client gateway:client`)")
    g.add_argument("--tls-ca", default=None)
    g.add_argument("--tls-cert", default=None)
    g.add_argument("--tls-key", default=None)

    co = sub.add_parser("coordinator", parents=[common],
                        help="serve a coordinator (multi-node deployments)")  # fmt: skip
    co.set_defaults(fn=cmd_coordinator)
    co.add_argument("--listen", default="127.0.0.1:7070",
                    help="host:port (beyond loopback only with TLS)")  # fmt: skip
    co.add_argument("--store", default=None, help="snapshot store URL ($SNAPSHOTTER_STORE)")
    co.add_argument("--no-encrypt", action="store_true",
                    help="store new snapshots' chunks in plaintext (default: sealed under each "
                    "tenant's data key; also SNAPSHOTTER_ENCRYPT=0)")  # fmt: skip
    co.add_argument("--agent-ttl", type=float, default=15.0,
                    help="seconds without a heartbeat before a node is not placed on (at least "
                    "3 of the heartbeat intervals agents are asked to keep)")
    co.add_argument("--max-heartbeats", type=float, default=512.0, metavar="PER_S",
                    help="heartbeats a second to take, at most: agents are asked to beat less "
                    "often than their --heartbeat when more would arrive (0: no bound)")
    co.add_argument("--agent-token-file", default=None,
                    help="a token to present to agents that listen on loopback without TLS")
    _metrics_arg(co, "9464")
    _log_args(co)
    _tls_args(co, "the coordinator")

    ag = sub.add_parser("agent", parents=[common],
                        help="serve this node's agent (multi-node deployments)")  # fmt: skip
    ag.set_defaults(fn=cmd_agent)
    ag.add_argument("--listen", default="127.0.0.1:7071",
                    help="NODE_IP:PORT; ranks of this node use NODE_IP and its interface")
    ag.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    ag.add_argument("--name", default=None, help="node name (default: the hostname)")
    ag.add_argument("--store", default=None, help="snapshot store URL ($SNAPSHOTTER_STORE)")
    ag.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="network setting for this node's ranks (wins over the job's, also "
                    "after a thaw onto this node)")
    ag.add_argument("--link", action="append", default=[], metavar="IFACE",
                    help="a data link for the ranks' communicators, in plane order "
                    "(repeatable, or comma-separated); with two or more, jobs move to "
                    "another link when theirs fails or is drained (default: the --listen "
                    "address's interface only)")
    ag.add_argument("--heartbeat", type=float, default=2.0)
    ag.add_argument("--freeze-lease", type=float, default=60.0,
                    help="seconds without word from the coordinator before a freeze is undone")
    ag.add_argument("--allow-python", action="append", default=[], metavar="PATH",
                    help="an interpreter (or a directory of them) jobs may use; the agent's "
                    "own is always allowed")
    ag.add_argument("--allow-cwd", action="append", default=[], metavar="DIR",
                    help="a directory jobs may run in (with everything below it)")
    ag.add_argument("--token-file", default=None,
                    help="a token to present to a coordinator on loopback without TLS")
    ag.add_argument("--no-keeper", dest="keeper", action="store_false",
                    help="run without a keeper: the agent's ranks then end with it (by default "
                    "a keeper process holds their pipes and restarts a crashed agent, which "
                    "re-adopts them; SIGHUP to it restarts the agent for an upgrade)")
    _metrics_arg(ag, "9465")
    _log_args(ag)
    _tls_args(ag, "the agent")

    ce = sub.add_parser("certs", help="make certificates for a cluster")
    ce_sub = ce.add_subparsers(dest="certs_cmd", required=True)
    ci = ce_sub.add_parser("init", help="a CA, the coordinator's, every node's and clients'")
    ci.set_defaults(fn=cmd_certs_init)
    ci.add_argument("dir")
    ci.add_argument("--nodes", required=True, help="comma-separated node names (agent --name)")
    ci.add_argument("--client", action="append", default=None, metavar="NAME:ROLE",
                    help="a client certificate (default admin:admin); repeatable")
    ci.add_argument("--san", action="append", default=[], metavar="NAME_OR_IP",
                    help="an extra name or address in the coordinator's certificate")
    ci.add_argument("--node-san", action="append", default=[], metavar="NODE=NAME_OR_IP",
                    help="an extra name or address in a node's certificate")

    tk = sub.add_parser("token", help="bearer tokens a service accepts")
    tk_sub = tk.add_subparsers(dest="token_cmd", required=True)
    tc = tk_sub.add_parser("create", parents=[common], help="add one; prints it once")
    tc.add_argument("--file", required=True, help="the service's token file (--tokens)")
    tc.add_argument("--name", required=True)
    tc.add_argument("--role", required=True, choices=[r.value for r in Role if r is not Role.ROOT])
    tc.add_argument("--ttl", type=duration, default=None, help="e.g. 12h, 30d (default: never)")
    tc.add_argument("--tenant", default=None,
                    help="the token sees and acts on this tenant's jobs and snapshots only "
                    "(roles viewer, operator)")  # fmt: skip
    tl = tk_sub.add_parser("list", parents=[common])
    tl.add_argument("--file", required=True)
    tr = tk_sub.add_parser("revoke", parents=[common])
    tr.add_argument("--file", required=True)
    tr.add_argument("id")
    for p in (tc, tl, tr):
        p.set_defaults(fn=cmd_token)
