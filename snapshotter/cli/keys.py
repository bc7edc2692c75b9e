"""`snapshotter keys show|rotate`: the coordinator's snapshot signing key (storage/signing.py)
and its tenants' data keys for encryption at rest (storage/datakeys.py).

They act on the key files of this host's SNAPSHOTTER_HOME (or SNAPSHOTTER_KEYS_DIR): run them
where the coordinator runs, and restart it after a rotation (it signs with the key it loaded).
"""

from __future__ import annotations

import argparse

from snapshotter.cli.output import emit_result
from snapshotter.config import Paths, default_home
from snapshotter.errors import InvalidArgument
from snapshotter.storage import signing
from snapshotter.storage.datakeys import DataKeys


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("keys", help="the coordinator's signing key and tenants' data keys")
    sub = p.add_subparsers(dest="keys_cmd", required=True)
    s = sub.add_parser("show", help="the signing key's id and public key, and the keys trusted")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_show)
    r = sub.add_parser("rotate", help="make a new signing key (what the old one signed still "
                       "thaws: its public key stays trusted), or with --tenant a new data key "
                       "(older snapshots still thaw with the old one)")  # fmt: skip
    r.add_argument("--tenant", default=None, help="rotate this tenant's data key instead")
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=cmd_rotate)


def cmd_show(a: argparse.Namespace) -> int:
    d = Paths(default_home()).keys_dir
    signer = signing.load_signer(d)
    ring = signing.load_keyring(d, signer)
    pem = signing.public_pem(signer.private.public_key()).decode()
    tenants = DataKeys(d).tenants()
    data_keys = {t: {"current": c, "keys": ids} for t, (c, ids) in tenants.items()}
    res = {"key_id": signer.key_id, "public_key": pem, "trusted": sorted(ring.keys),
           "keys_dir": str(d), "data_keys": data_keys}  # fmt: skip
    data = "".join(f"tenant {t}: data key {cur} ({len(ids)} kept)\n"
                   for t, (cur, ids) in tenants.items())  # fmt: skip
    emit_result(res, a.json, None, text=(
        f"signing key {signer.key_id} ({d})\ntrusted: {', '.join(res['trusted'])}\n{data}"
        f"public key (copy into another coordinator's {signing.TRUSTED}/ to trust this one's "
        f"snapshots there):\n{pem}"))  # fmt: skip
    return 0


def cmd_rotate(a: argparse.Namespace) -> int:
    d = Paths(default_home()).keys_dir
    if a.tenant is not None:
        try:
            old_id, new_id = DataKeys(d).rotate(a.tenant)
        except ValueError as e:
            raise InvalidArgument(str(e), "name an existing or new tenant") from e
        emit_result({"tenant": a.tenant, "old_key_id": old_id, "key_id": new_id,
                     "keys_dir": str(d)}, a.json,
                    f"tenant {a.tenant}: data key {old_id or '(none)'} kept for older "
                    f"snapshots, new snapshots use {new_id}")  # fmt: skip
        return 0
    old, new = signing.rotate(d)
    emit_result({"old_key_id": old, "key_id": new, "keys_dir": str(d)}, a.json,
                f"signing key {old} retired (still trusted), new key {new}; restart the "
                "coordinator to sign with it")  # fmt: skip
    return 0
