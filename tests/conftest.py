"""Shared fixtures. End-to-end tests need root and CRIU; they are skipped with a reason
otherwise (CI runs as root after deploy/install.sh, so there they run)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.cli import SnapCli


def _criu_ready() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        from snapshotter.sandbox.criu import criu_binary

        criu_binary()
    except Exception as e:  # noqa: BLE001 - any reason is a skip reason
        return f"CRIU unavailable: {e}"
    return None


def skip_without_criu() -> None:
    reason = _criu_ready()
    if reason:
        pytest.skip(reason)


@pytest.fixture()
def make_snap(tmp_path: Path) -> Iterator[Callable[..., SnapCli]]:
    """`make_snap(env)`: a CLI with its own home and extra environment, closed at teardown."""
    skip_without_criu()
    made: list[SnapCli] = []

    def make(extra_env: dict[str, str] | None = None) -> SnapCli:
        cli = SnapCli(tmp_path / f"home{len(made) or ''}", extra_env)
        made.append(cli)
        return cli

    try:
        yield make
    finally:
        for cli in made:
            cli.close()


@pytest.fixture()
def snap(make_snap: Callable[..., SnapCli]) -> SnapCli:
    return make_snap()
