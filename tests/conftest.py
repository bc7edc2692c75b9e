"""Shared fixtures. End-to-end tests need root and CRIU; they are skipped with a reason
otherwise (CI runs as root after deploy/install.sh, so there they run).

Every test, and every module, is checked afterwards for processes it started that still run
(tests/support/procs.py): they are named in the failure and ended.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.cli import SnapCli
from tests.support.disk import shed_bulk
from tests.support.procs import CENSUS, guard


def pytest_configure(config: pytest.Config) -> None:
    CENSUS.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    CENSUS.stop()


def pytest_report_header(config: pytest.Config) -> str:
    return f"process census: {CENSUS.mechanism}"


@pytest.fixture(autouse=True, scope="module")
def _no_process_left_by_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    with guard("module", f"module {request.module.__name__}"):
        yield


@pytest.fixture(autouse=True)
def _no_process_left_by_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    with guard("function", f"test {request.node.name}"):
        yield


@pytest.fixture(autouse=True)
def _no_bulk_kept_by_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A passed test's tmp_path goes (tmp_path_retention_policy = "failed"); a failed one's is
    kept for a look, less its images and chunks (set up first, so this runs after every other
    fixture of the test has ended its daemons)."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if isinstance(tmp, Path):
        shed_bulk(tmp)


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


@pytest.fixture
def format_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers in this test write format 1 (per-snapshot chunks), what agents write while a
    fleet still has readers of only that format: its own layout and its own failure paths."""
    monkeypatch.setenv("SNAPSHOTTER_FORMAT_VERSION", "1")
