"""TLS for the control plane: a small certificate authority for a cluster, and the files a
process presents.

`snapshotter certs init DIR --nodes a,b` writes (keys 0600, the directory 0700)::

    DIR/ca.crt, ca.key                 the cluster CA: keep ca.key offline once nodes have certs
    DIR/coordinator.crt, .key          OU=coordinator; SAN DNS:coordinator (+ --san values)
    DIR/nodes/<name>.crt, .key         OU=node;        SAN DNS:<name> (+ --san <name>=VALUE)
    DIR/clients/<name>.crt, .key       OU=<role>: admin by default (--client NAME:ROLE)

Every service and client verifies its peer against ca.crt, and TLS is always mutual. The role
of a peer is the OU of its certificate, its name the CN; servers are verified by name (the
coordinator as "coordinator", an agent as its node name), not by address, so a node keeps its
certificate when its address changes. Existing PKI works the same: certificates with the role
in the OU, and `--tls-ca/--tls-cert/--tls-key` naming the files (README: "TLS").
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from snapshotter import errors

COORDINATOR_NAME = "coordinator"
VALID_DAYS = 825


@dataclass(frozen=True)
class TlsFiles:
    """What one process presents and trusts."""

    ca: Path
    cert: Path
    key: Path

    @staticmethod
    def in_dir(tls_dir: Path, name: str) -> TlsFiles:
        """DIR/ca.crt and DIR/<name>.crt/.key (name: coordinator, nodes/a, clients/admin)."""
        return TlsFiles(tls_dir / "ca.crt", tls_dir / f"{name}.crt", tls_dir / f"{name}.key")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert chain, key) PEM bytes.

        Raises: InvalidArgument naming the file that is missing or unreadable.
        """
        out = []
        for what, p in (("CA certificate", self.ca), ("certificate", self.cert), ("key", self.key)):
            try:
                out.append(p.read_bytes())
            except OSError as e:
                raise errors.InvalidArgument(
                    f"cannot read the TLS {what} {p}: {e.strerror}",
                    "make the files with `snapshotter certs init DIR --nodes ...` or point "
                    "--tls-ca/--tls-cert/--tls-key at yours",
                ) from e
        return out[0], out[1], out[2]


def tls_files(
    tls_dir: str | None, name: str, ca: str | None, cert: str | None, key: str | None
) -> TlsFiles | None:
    """The files named explicitly (all three), else DIR's files for `name`, else None.

    Raises: InvalidArgument if only some of ca/cert/key are given.
    """
    explicit = [ca, cert, key]
    if any(explicit):
        if not all(explicit):
            raise errors.InvalidArgument(
                "a TLS CA, certificate and key go together", "give all three (or --tls-dir)"
            )
        return TlsFiles(Path(ca), Path(cert), Path(key))  # type: ignore[arg-type]
    if tls_dir:
        return TlsFiles.in_dir(Path(tls_dir), name)
    return None


# ---- the cluster CA ----------------------------------------------------------------------


def init_ca(
    out: Path,
    nodes: Sequence[str],
    clients: Sequence[tuple[str, str]] = (("admin", "admin"),),
    coordinator_sans: Sequence[str] = (),
    node_sans: Sequence[tuple[str, str]] = (),
) -> list[Path]:
    """Make a CA and the certificates of a small cluster under `out`; return what was written.

    Raises:
        InvalidArgument: `out` already holds a CA (never overwritten), or a name is unusable.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if (out / "ca.key").exists() or (out / "ca.crt").exists():
        raise errors.InvalidArgument(
            f"{out} already holds a CA", "choose an empty directory (a CA is never overwritten)"
        )
    for n in [*nodes, *(c for c, _ in clients)]:
        if not n or "/" in n or n.startswith("."):
            raise errors.InvalidArgument(f"unusable certificate name {n!r}", "use plain names")
    now = datetime.datetime.now(datetime.UTC)
    written: list[Path] = []
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "snapshotter cluster CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS * 2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    written += _write_pair(out / "ca", ca_cert, ca_key)

    def issue(path: Path, cn: str, role: str, sans: Sequence[str]) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for s in sans:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(s)))
            except ValueError:
                names.append(x509.DNSName(s))
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.COMMON_NAME, cn),
                        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    ]
                )
            )
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        written.extend(_write_pair(path, cert, key))

    issue(
        out / COORDINATOR_NAME,
        COORDINATOR_NAME,
        "coordinator",
        [COORDINATOR_NAME, *coordinator_sans],
    )
    extra: dict[str, list[str]] = {}
    for n, v in node_sans:
        extra.setdefault(n, []).append(v)
    for n in nodes:
        issue(out / "nodes" / n, n, "node", [n, *extra.get(n, [])])
    for n, role in clients:
        issue(out / "clients" / n, n, role, [n])
    return written


def _write_pair(stem: Path, cert: object, key: object) -> list[Path]:
    from cryptography.hazmat.primitives import serialization

    stem.parent.mkdir(parents=True, exist_ok=True)
    crt, k = stem.with_suffix(".crt"), stem.with_suffix(".key")
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))  # type: ignore[attr-defined]
    fd = os.open(k, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(  # type: ignore[attr-defined]
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return [crt, k]
