"""`snapshotter tenant set|show`: per-tenant limits on snapshots (coordinator/quotas.py).

They edit the limits file of this host's SNAPSHOTTER_HOME: run them where the coordinator runs;
it re-reads the file when it changes (no restart).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict

from snapshotter.cli.output import emit_result
from snapshotter.config import Paths, default_home
from snapshotter.coordinator.quotas import Limits, TenantLimits
from snapshotter.coordinator.tenants import check_name
from snapshotter.coordinator.webhooks import WebhookConfig
from snapshotter.errors import InvalidArgument

_SIZE = re.compile(r"^(\d+)([KMGT]?)$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size(v: str) -> int:
    m = _SIZE.match(v.strip().upper().removesuffix("B").removesuffix("I"))
    if not m:
        raise argparse.ArgumentTypeError(f"{v!r} is not a size like 500M, 50G or 2T")
    return int(m.group(1)) * _UNITS[m.group(2)]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("tenant", help="per-tenant limits on snapshots")
    sub = p.add_subparsers(dest="tenant_cmd", required=True)
    s = sub.add_parser("set", help="set a tenant's limits (the ones given; 'none' lifts one)")
    s.add_argument("tenant")
    s.add_argument("--max-stored", default=None, metavar="SIZE|none",
                   help="bytes of committed snapshots, e.g. 50G")  # fmt: skip
    s.add_argument("--max-freezes", default=None, metavar="N|none",
                   help="freezes of its jobs running at once")  # fmt: skip
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_set)
    w = sub.add_parser("webhook", help="where the tenant's job events are POSTed (signed)")
    w.add_argument("tenant")
    which = w.add_mutually_exclusive_group(required=True)
    which.add_argument("--url", default=None, help="https:// (http:// to loopback only)")
    which.add_argument("--none", action="store_true", help="send its events nowhere")
    w.add_argument("--json", action="store_true")
    w.set_defaults(fn=cmd_webhook)
    sh = sub.add_parser("show", help="every tenant's limits")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(fn=cmd_show)


def _limits() -> TenantLimits:
    return TenantLimits(Paths(default_home()).tenants_file)


def _value(v: str | None, old: int | None, parse: type | object, flag: str) -> int | None:
    if v is None:
        return old
    if v.strip().lower() == "none":
        return None
    try:
        return size(v) if parse is size else int(v)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise InvalidArgument(f"{flag} {v!r}: {e}", f"pass a number for {flag}, or none") from e


def cmd_set(a: argparse.Namespace) -> int:
    check_name(a.tenant)
    limits = _limits()
    old = limits.get(a.tenant)
    new = Limits(
        max_stored_bytes=_value(a.max_stored, old.max_stored_bytes, size, "--max-stored"),
        max_concurrent_freezes=_value(a.max_freezes, old.max_concurrent_freezes, int,
                                      "--max-freezes"),  # fmt: skip
    )
    if any(v is not None and v < 0 for v in asdict(new).values()):
        raise InvalidArgument("a limit below 0", "pass 0 or more, or none")
    limits.set(a.tenant, new)
    emit_result({"tenant": a.tenant, **asdict(new)}, a.json,
                f"tenant {a.tenant}: {_describe(new)}")  # fmt: skip
    return 0


def cmd_webhook(a: argparse.Namespace) -> int:
    check_name(a.tenant)
    secret = WebhookConfig(Paths(default_home()).webhooks_file).set(a.tenant, a.url)
    if secret is None:
        emit_result({"tenant": a.tenant, "url": None}, a.json, f"tenant {a.tenant}: no webhook")
        return 0
    emit_result({"tenant": a.tenant, "url": a.url, "secret": secret}, a.json,
                f"tenant {a.tenant}: events go to {a.url}; their signing secret (shown only "
                f"now; verify with X-Snapshotter-Signature):\n{secret}")  # fmt: skip
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    every = _limits().all()
    emit_result({"tenants": {t: asdict(x) for t, x in sorted(every.items())}}, a.json, None,
                text="\n".join(f"{t}: {_describe(x)}" for t, x in sorted(every.items()))
                or "no tenant has limits")  # fmt: skip
    return 0


def _describe(x: Limits) -> str:
    stored = "unlimited" if x.max_stored_bytes is None else f"{x.max_stored_bytes} bytes"
    freezes = "unlimited" if x.max_concurrent_freezes is None else str(x.max_concurrent_freezes)
    return f"stored snapshots {stored}, freezes at once {freezes}"
