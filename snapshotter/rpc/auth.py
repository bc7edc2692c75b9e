"""Who is calling, and may they: identities from the transport, rights from the contract.

Every rpc declares the right it needs in the .proto files (`option (snapshotter.v1.required)
= ...`); `method_rights()` reads them from the generated descriptors, so the contract is the
one table of rights. Roles grant rights (ROLE_RIGHTS). A caller's identity comes from, first
match wins:

  a bearer token   `authorization: Bearer snp_<id>.<secret>` metadata, checked against the
                   server's token file (TokenStore): its name and role
  a certificate    the TLS client certificate (mutual TLS): CN is the name, OU the role
  the transport    a unix socket only root can open (the embedded daemon): root, every right
  --insecure       anyone, with every right (tests only; the server says so loudly)

A bad token is refused outright (it never falls back to the certificate). Nothing here does
network I/O; the token file is re-read when it changes, so `snapshotter token create` takes
effect without a restart.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2

Right = common_pb2.Right


class Role(enum.Enum):
    ROOT = "root"  # root on the service's host (its unix socket), or anyone under --insecure
    ADMIN = "admin"
    OPERATOR = "operator"
    VIEWER = "viewer"
    NODE = "node"  # a node agent, toward the coordinator
    COORDINATOR = "coordinator"  # the coordinator, toward the node agents
    CLIENT = "client"  # a machine certificate that may connect; a token says who acts


ROLE_RIGHTS: Mapping[Role, frozenset[int]] = {
    Role.ROOT: frozenset(Right.values()) - {Right.RIGHT_UNSPECIFIED},
    Role.VIEWER: frozenset({Right.VIEW}),
    Role.OPERATOR: frozenset({Right.VIEW, Right.OPERATE}),
    Role.ADMIN: frozenset({Right.VIEW, Right.OPERATE, Right.ADMINISTER}),
    # A node reads a migrating rank's images from another node (agent/handoff.py).
    Role.NODE: frozenset({Right.REGISTER, Right.TRANSFER}),
    Role.COORDINATOR: frozenset({Right.DRIVE, Right.VIEW}),
    Role.CLIENT: frozenset(),
}

TOKEN_PREFIX = "snp_"


def right_name(right: int) -> str:
    return str(Right.Name(right))  # type: ignore[arg-type]


def granting(right: int) -> list[str]:
    """The roles that grant `right` (for error messages)."""
    return [r.value for r, rights in ROLE_RIGHTS.items() if right in rights]


def method_rights() -> dict[str, int]:
    """'/snapshotter.v1.Service/Method' -> the Right it requires, for every method of the
    contract (a method without the option requires ADMINISTER: refuse by default)."""
    out: dict[str, int] = {}
    ext = common_pb2.required
    for module in (coordinator_pb2, agent_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                opts = m.GetOptions()
                right = opts.Extensions[ext] if opts.HasExtension(ext) else Right.ADMINISTER
                out[f"/{service.full_name}/{m.name}"] = right
    return out


# Roles a tenant-scoped token may have: a tenant acts on its own jobs and snapshots, never on
# the cluster (nodes, drains, links, gc are ADMINISTER).
TENANT_ROLES = (Role.VIEWER, Role.OPERATOR)


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role
    via: str  # token | certificate | unix | insecure
    tenant: str | None = None  # set: sees and acts on this tenant's jobs and snapshots only

    def __str__(self) -> str:
        scope = f", tenant {self.tenant}" if self.tenant is not None else ""
        return f"{self.name} ({self.role.value}{scope}, by {self.via})"


# Methods a tenant's token may call with a lesser right than the contract's, because the
# service confines a tenant to its own (coordinator/service.py): deleting a snapshot is an
# admin's act on the cluster's store, but a tenant's operator may delete the tenant's own.
TENANT_OWN_RIGHTS: Mapping[str, int] = {"DeleteSnapshot": Right.OPERATE}


def required_right(who: Identity, method: str, right: int) -> int:
    """The right `who` needs for `method`, whose contract requires `right`."""
    if who.tenant is not None:
        return TENANT_OWN_RIGHTS.get(method.rsplit("/", 1)[-1], right)
    return right


def authorize(who: Identity, method: str, right: int) -> None:
    """Raises: PermissionDenied naming the missing right and the roles that have it."""
    right = required_right(who, method, right)
    if right in ROLE_RIGHTS[who.role]:
        return
    name = right_name(right)
    raise errors.PermissionDenied(
        f"{who} may not call {method.rsplit('/', 1)[-1]}: it needs the {name} right, "
        f"which the {who.role.value} role does not have",
        f"use a token or certificate of a role with {name} ({', '.join(granting(right))})",
        right=name,
        identity=str(who),
    )


# ---- tokens ------------------------------------------------------------------------------


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenStore:
    """Bearer tokens of one server, in a JSON file only root can read:

        {"tokens": [{"id": ID, "name": N, "role": R, "sha256": H, "created": T,
                     "expires": T | null}]}

    Only the sha256 of each secret is kept; a token is `snp_<id>.<secret>` and is shown once,
    when created.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._tokens: dict[str, dict[str, Any]] = {}

    def _load(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            try:
                mtime = self.path.stat().st_mtime
            except FileNotFoundError:
                self._tokens, self._mtime = {}, None
                return self._tokens
            if mtime != self._mtime:
                data = json.loads(self.path.read_text() or "{}")
                self._tokens = {t["id"]: t for t in data.get("tokens", [])}
                self._mtime = mtime
            return self._tokens

    def _save(self, tokens: Mapping[str, Mapping[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"tokens": list(tokens.values())}, f, indent=1)
        os.replace(tmp, self.path)

    def create(self, name: str, role: Role, ttl_s: float | None, now: float | None = None,
               tenant: str | None = None) -> str:  # fmt: skip
        """Add a token; return it (the only time its secret is visible). `tenant`: the token
        acts on that tenant's jobs and snapshots only (roles in TENANT_ROLES)."""
        if tenant is not None and role not in TENANT_ROLES:
            raise errors.InvalidArgument(
                f"a tenant's token cannot have the {role.value} role",
                f"use --role {' or '.join(r.value for r in TENANT_ROLES)} with --tenant",
            )
        now = time.time() if now is None else now
        ident, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        tokens = dict(self._load())
        tokens[ident] = {
            "id": ident,
            "name": name,
            "role": role.value,
            "sha256": _digest(secret),
            "created": now,
            "expires": None if ttl_s is None else now + ttl_s,
            "tenant": tenant,
        }
        self._save(tokens)
        return f"{TOKEN_PREFIX}{ident}.{secret}"

    def revoke(self, ident: str) -> bool:
        tokens = dict(self._load())
        if tokens.pop(ident, None) is None:
            return False
        self._save(tokens)
        return True

    def list(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in t.items() if k != "sha256"} for t in self._load().values()]

    def verify(self, token: str, now: float | None = None) -> Identity:
        """Raises: Unauthenticated (malformed, unknown or forged, expired)."""
        now = time.time() if now is None else now
        body = token.removeprefix(TOKEN_PREFIX)
        ident, _, secret = body.partition(".")
        if not token.startswith(TOKEN_PREFIX) or not ident or not secret:
            raise errors.Unauthenticated(
                "the bearer token is malformed (expected snp_<id>.<secret>)",
                "pass the token exactly as `snapshotter token create` printed it",
            )
        rec = self._load().get(ident)
        if rec is None or not hmac.compare_digest(rec["sha256"], _digest(secret)):
            raise errors.Unauthenticated(
                f"unknown or forged token (id {ident!r}) for this service",
                "ask an admin for a token (`snapshotter token create` on the service's host)",
            )
        if rec.get("expires") is not None and now >= float(rec["expires"]):
            raise errors.Unauthenticated(
                f"token {ident!r} of {rec['name']} expired at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(rec['expires']))}",
                "ask an admin for a new token",
            )
        tenant = rec.get("tenant")
        return Identity(name=str(rec["name"]), role=Role(rec["role"]), via="token",
                        tenant=None if tenant is None else str(tenant))  # fmt: skip


def bearer(metadata: Mapping[str, str]) -> str | None:
    value = metadata.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise errors.Unauthenticated(
            "the authorization metadata is not 'Bearer <token>'", "send the token as a bearer"
        )
    return token.strip()


def role_of_certificate(pem: bytes) -> tuple[str, Role]:
    """(CN, role from OU) of a peer certificate.

    Raises: Unauthenticated if the certificate names no role snapshotter knows.
    """
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem)
    cn = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    ou = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    name = str(cn[0]) if cn else "?"
    for value in ou:
        try:
            return name, Role(str(value))
        except ValueError:
            continue
    raise errors.Unauthenticated(
        f"the client certificate of {name!r} names no snapshotter role (its OU is {ou or 'unset'})",
        "issue certificates with OU set to a role (admin, operator, viewer, node, coordinator, "
        "client), e.g. with `snapshotter certs init`",
    )
