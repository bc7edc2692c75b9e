"""The example Grafana dashboard (deploy/grafana/snapshotter-dashboard.json) against the metrics
the services really export (snapshotter/metrics.py): it is a dashboard Grafana imports, every
metric and label its queries name is exported under that name, and every metric family the code
defines is on some panel, so adding a metric without a panel fails here.

What is exported is read from the registries themselves (`collect()`), never from a list kept
here. Nothing here adds a series to those registries: each service serves them.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from snapshotter import metrics
from snapshotter.v1 import common_pb2

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/snapshotter-dashboard.json"

# Families no panel shows, each with why.
NOT_ON_DASHBOARD = {
    "process_virtual_memory_bytes": "a Python process with CUDA maps tens of GiB it never "
    "touches: its virtual size says nothing; resident memory is shown",
}

# Labels Prometheus attaches to every series it scrapes (target labels), not the exporter.
TARGET_LABELS = frozenset({"job", "instance"})

# The series a family is exported under, by its type, whether or not it has any yet (`_created`
# comes with them as prometheus_client exports it; it is taken from the samples when there).
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}

AGGREGATIONS = frozenset(
    "sum avg min max count group stddev stdvar topk bottomk quantile count_values".split()
)
FUNCTIONS = AGGREGATIONS | frozenset(
    """abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min
    count_over_time day_of_month day_of_week delta deriv exp floor histogram_quantile holt_winters
    hour idelta increase irate label_join label_replace last_over_time ln log2 log10
    max_over_time min_over_time minute month predict_linear quantile_over_time rate resets round
    scalar sgn sort sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time time timestamp
    vector year""".split()
)
KEYWORDS = frozenset("and or unless bool offset".split())
GRAFANA_VARIABLES = frozenset(
    "__rate_interval __interval __interval_ms __range __range_s __range_ms __dashboard".split()
)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*(?:,|$)')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_NUMBER = re.compile(r"(?<![\w:.])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[A-Za-z_:][\w:]*(\s*\()?")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$")


# ---- what the services export -------------------------------------------------------------------
@dataclass
class Family:
    name: str
    type: str
    labels: set[str] = field(default_factory=set)
    series: set[str] = field(default_factory=set)  # the names its samples are exported under

    def labels_of(self, series: str) -> set[str]:
        """The labels a query may name on `series`: `le` only on a histogram's buckets."""
        return self.labels | TARGET_LABELS | ({"le"} if series.endswith("_bucket") else set())


def _declared_labels(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Each metric object's label names, by family name.

    A labelled family with no series yet has no samples to read them from, and making one to look
    (`.labels(...)`) would export a zero-valued series from the registry a service serves;
    prometheus_client keeps them only on the object, and lists a registry's objects only in it.
    """
    out: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            for family in collector.describe():
                out[family.name] = tuple(collector._labelnames)
    return out


def _census_registry() -> CollectorRegistry:
    """The coordinator's census gauges (`watch_coordinator`), in a scratch registry: the real one
    takes them once, when a coordinator starts."""
    scratch = CollectorRegistry()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics, "COORDINATOR", scratch)
        metrics.watch_coordinator(lambda: {"live": 1, "lost": 0}, lambda: {"ACTIVE": 1})
    return scratch


def _ranks_registry() -> CollectorRegistry:
    """An agent's rank gauges (`watch_ranks`) over one sampled job, in a scratch registry: the
    real one takes them once, when an agent starts."""
    scratch = CollectorRegistry()
    job = common_pb2.JobProgress(job_id="j", ranks=[common_pb2.RankProgress(
        rank=0, answered=True, step_s=0.1, in_flight_s=0.01,
        timings=[common_pb2.CollectiveTiming(group="0", done=5, window=5, mean_s=0.02)])],
        peers=[common_pb2.PeerStats(address="10.0.0.2", rtt_ms=0.3)])  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics, "AGENT", scratch)
        metrics.watch_ranks(lambda: [job])
    return scratch


@functools.cache
def exported() -> dict[str, Family]:
    """Every family the coordinator and the agents export, by name."""
    families: dict[str, Family] = {}
    for registry in (metrics.COORDINATOR, metrics.AGENT, _census_registry(), _ranks_registry()):
        declared = _declared_labels(registry)
        for mf in registry.collect():
            assert mf.type in SUFFIXES, f"{mf.name}: no rule here for a {mf.type}'s series names"
            fam = families.setdefault(mf.name, Family(mf.name, mf.type))
            assert fam.type == mf.type, f"{mf.name} is a {fam.type} and a {mf.type}"
            fam.series |= {mf.name + s for s in SUFFIXES[mf.type]}
            fam.series |= {s.name for s in mf.samples}
            fam.labels |= {k for s in mf.samples for k in s.labels} - {"le", "quantile"}
            fam.labels |= set(declared.get(mf.name, ()))
    return families


def by_series(families: dict[str, Family]) -> dict[str, Family]:
    return {s: f for f in families.values() for s in f.series}


# ---- what the dashboard asks --------------------------------------------------------------------
@dataclass
class Query:
    metrics: set[str] = field(default_factory=set)
    matchers: list[tuple[str, str]] = field(default_factory=list)  # (metric, label) in a {...}
    grouping: set[str] = field(default_factory=set)  # by/without/on/ignoring/group_* labels
    aggregates: bool = False
    problems: list[str] = field(default_factory=list)


def parse(expr: str) -> Query:
    """The metrics and labels a PromQL expression names (enough PromQL for dashboards: selectors,
    ranges, function calls, aggregations with their grouping, binary operators)."""
    q = Query()
    for name, body in _SELECTOR.findall(expr):
        if not name:
            q.problems.append(f"a selector without a metric name: {{{body}}}")
            continue
        q.metrics.add(name)
        labels = _MATCHER.findall(body)
        if _MATCHER.sub("", body).strip():
            q.problems.append(f"unparsed matchers in {name}{{{body}}}")
        q.matchers += [(name, label) for label in labels]
    rest = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", expr)
    rest = _RANGE.sub(" ", _STRING.sub(" ", rest))
    for labels in _GROUPING.findall(rest):
        q.grouping |= {x.strip() for x in labels.split(",") if x.strip()}
    rest = _NUMBER.sub(" ", _GROUPING.sub(" ", rest))
    for m in _IDENT.finditer(rest):
        word = m.group(0).rstrip("( \t\n")
        if m.group(1):  # a call
            if word not in FUNCTIONS:
                q.problems.append(f"unknown function {word}()")
            q.aggregates |= word in AGGREGATIONS
        elif word not in KEYWORDS:
            q.metrics.add(word)
    return q


def check_query(expr: str, families: dict[str, Family], legend: str = "") -> list[str]:
    """What in `expr` (and its legend) the services do not export: names, labels, functions."""
    q = parse(expr)
    problems = list(q.problems)
    series = by_series(families)
    for name in sorted(q.metrics):
        if name not in series:
            problems.append(f"{name} is not exported")
    for name, label in q.matchers:
        if name in series and label not in series[name].labels_of(name):
            problems.append(f"{name} has no label {label!r}")
    for name in sorted(q.metrics & series.keys()):
        for label in sorted(q.grouping - series[name].labels_of(name)):
            problems.append(f"{name} has no label {label!r} to group by")
    for label in _LEGEND.findall(legend):
        if q.aggregates and label not in q.grouping:
            problems.append(f"legend label {label!r} is aggregated away in {expr}")
        for name in sorted(q.metrics & series.keys()):
            if label not in series[name].labels_of(name):
                problems.append(f"legend label {label!r} is not a label of {name}")
    return [f"{p} (in {expr})" for p in problems]


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def _queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, expr, legend) of every panel target and query variable."""
    out = []
    for p in _panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p.get('title')!r}", t.get("expr", ""), t.get("legendFormat", "")))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = _LABEL_VALUES.match(q)
            assert m, f"variable {v['name']}: not label_values(SELECTOR, LABEL): {q}"
            selector, label = m.groups()
            out.append((f"variable {v['name']!r}", f"sum by ({label}) ({selector})", ""))
    return out


# ---- the tests ----------------------------------------------------------------------------------
def test_it_is_a_dashboard_grafana_imports() -> None:
    dash = _dashboard()
    assert dash["schemaVersion"] >= 39, f"schemaVersion {dash['schemaVersion']}: Grafana 10.3+"
    assert dash["title"] and dash["uid"]
    inputs = {i["name"]: i for i in dash["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    assert "${DS_PROMETHEUS}" in DASHBOARD.read_text(), "the DS_PROMETHEUS input is never used"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "node"):
        assert variables[name]["type"] == "query", name
        assert variables[name]["datasource"] == DATASOURCE, name


def test_panels_have_unique_ids_and_places_that_do_not_overlap() -> None:
    panels = _panels(_dashboard())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    boxes: list[tuple[str, int, int, int, int]] = []
    for p in panels:
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= g.keys(), p["title"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for title, x, y, w, h in boxes:
            overlap = x < g["x"] + g["w"] and g["x"] < x + w and y < g["y"] + g["h"]
            assert not (overlap and g["y"] < y + h), f"{p['title']!r} overlaps {title!r}"
        boxes.append((p["title"], g["x"], g["y"], g["w"], g["h"]))


def test_every_panel_queries_the_chosen_datasource() -> None:
    for p in _panels(_dashboard()):
        if p["type"] == "row":
            assert not p.get("targets"), p["title"]
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], f"{p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{p['title']!r}: duplicate refIds {refs}"
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE, p["title"]
            assert t["expr"].strip(), f"{p['title']!r} {t['refId']}: no expr"


def test_every_variable_a_query_uses_is_defined() -> None:
    dash = _dashboard()
    defined = {v["name"] for v in dash["templating"]["list"]} | GRAFANA_VARIABLES
    for where, expr, _ in _queries(dash):
        for groups in _VARIABLE.findall(expr):
            name = next(g for g in groups if g)
            assert name in defined, f"{where}: ${name} is not a variable"


def test_every_metric_and_label_the_dashboard_names_is_exported() -> None:
    families = exported()
    problems = [
        f"{where}: {p}"
        for where, expr, legend in _queries(_dashboard())
        for p in check_query(expr, families, legend)
    ]
    assert not problems, "\n".join(problems)


def test_every_metric_family_is_on_a_panel() -> None:
    families = exported()
    series = by_series(families)
    shown = {
        series[name].name
        for p in _panels(_dashboard())
        for t in p.get("targets", [])
        for name in parse(t["expr"]).metrics
        if name in series
    }
    missing = sorted(families.keys() - shown - NOT_ON_DASHBOARD.keys())
    assert not missing, f"no panel shows {missing}: add one, or say why in NOT_ON_DASHBOARD"
    unknown = sorted(NOT_ON_DASHBOARD.keys() - families.keys())
    assert not unknown, f"NOT_ON_DASHBOARD names {unknown}, which are not exported"
    stale = sorted(NOT_ON_DASHBOARD.keys() & shown)
    assert not stale, f"{stale} are on a panel: take them out of NOT_ON_DASHBOARD"


def test_the_families_the_code_defines_are_the_ones_checked() -> None:
    # The check is only as good as the catalogue: these are defined in metrics.py and must be in
    # it, whether or not they have a series yet.
    families = exported()
    for name, kind in [
        ("snapshotter_operations", "counter"),
        ("snapshotter_operation_phase_seconds", "histogram"),
        ("snapshotter_transfer_bytes", "counter"),
        ("snapshotter_agents", "gauge"),
    ]:
        assert families[name].type == kind
    assert families["snapshotter_operation_phase_seconds"].labels == {"op", "phase"}
    assert families["snapshotter_jobs"].labels == {"state"}
    assert "snapshotter_operations_total" in families["snapshotter_operations"].series
    assert "snapshotter_rpc_seconds_bucket" in families["snapshotter_rpc_seconds"].series


@pytest.mark.parametrize(
    ("expr", "legend", "problem"),
    [
        ("rate(snapshotter_operations[5m])", "", "snapshotter_operations is not exported"),
        ("snapshotter_operation_seconds_total", "", "is not exported"),
        ('sum(rate(snapshotter_operations_total{cause="x"}[5m]))', "", "no label 'cause'"),
        ("sum by (node) (snapshotter_agents)", "", "no label 'node' to group by"),
        ("sum by (le) (rate(snapshotter_operation_seconds_sum[5m]))", "", "no label 'le'"),
        ("sum by (op) (rate(snapshotter_operations_total[5m]))", "{{outcome}}", "aggregated away"),
        ("snapshotter_agents", "{{node}}", "not a label of snapshotter_agents"),
        ("ratee(snapshotter_operations_total[5m])", "", "unknown function ratee()"),
        ('snapshotter_agents{state="live" job="x"}', "", "unparsed matchers"),
    ],
)
def test_the_check_finds_what_is_wrong(expr: str, legend: str, problem: str) -> None:
    problems = check_query(expr, exported(), legend)
    assert any(problem in p for p in problems), problems


def test_the_check_passes_what_is_right() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, op) ("
        'rate(snapshotter_operation_seconds_bucket{job=~"$job", op=~"$op"}[$__rate_interval])'
        ")) / 1e3 or vector(0)"
    )
    assert check_query(expr, exported(), "{{op}}") == []
    assert parse(expr).metrics == {"snapshotter_operation_seconds_bucket"}
