"""docs/grafana/kvray.json against `kvray.metrics`: every metric its queries name exists under that
name where it is exported (Ray's export of an agent's metrics: `ray_kvray_*`; vLLM's /metrics:
`vllm:kvray_*`; Ray Serve LLM's export of those: `ray_vllm_kvray_*`), with the suffix of its kind
and only labels it has; and every operator metric is charted in each of the three."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvray.metrics import METRICS, OPERATOR_METRICS, MetricKind, MetricSpec, kind_tags

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvray.json"

#: Where a name comes from, by prefix (longest first: `ray_vllm_kvray_` is not `ray_kvray_`).
RAY_AGENT, VLLM, SERVE_LLM = "ray_kvray_", "vllm:kvray_", "ray_vllm_kvray_"
_NAME = re.compile(r"(ray_vllm_kvray_|vllm:kvray_|ray_kvray_)(\w+)")
_SUFFIXES = {
    MetricKind.COUNTER: ("_total",),
    MetricKind.GAUGE: ("",),
    MetricKind.HISTOGRAM: ("_bucket", "_sum", "_count"),
}
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
#: vLLM's own labels on its metrics (`vllm.v1.metrics.loggers.PrometheusStatLogger`).
_VLLM_LABELS = frozenset({"model_name", "engine"})
_SPECS = {spec.name: spec for spec in METRICS}


def load() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panels' targets and the variables' queries."""
    found = [target["expr"] for panel in panels(dashboard["panels"]) for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            found.append(query["query"])
    return found


def spec_of(prefix: str, rest: str) -> MetricSpec:
    """The kvray metric a scraped name is, checked against its kind's suffixes and its source."""
    for spec in METRICS:
        base = spec.name.removeprefix("kvray_")
        for suffix in _SUFFIXES[spec.kind]:
            if rest == base + suffix:
                if prefix != RAY_AGENT:
                    assert spec in OPERATOR_METRICS, f"{prefix}{rest}: vLLM exports operator metrics only"
                return spec
    raise AssertionError(f"{prefix}{rest} is no kvray metric with its kind's suffix (kvray.metrics.METRICS)")


def labels_of(prefix: str, spec: MetricSpec) -> set[str]:
    labels = set(spec.tag_keys) if prefix == RAY_AGENT else {*_VLLM_LABELS, *kind_tags(spec)}
    if prefix == SERVE_LLM:
        labels.add("ReplicaId")  # vLLM's Ray wrappers add it
    if spec.kind is MetricKind.HISTOGRAM:
        labels.add("le")
    return labels


def test_the_dashboard_is_grafana_json_whose_variables_are_defined() -> None:
    dashboard = load()
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard)))
    assert used - {"__rate_interval"} <= variables
    ids = [panel["id"] for panel in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for expression in queries(dashboard):
        assert expression.count("(") == expression.count(")"), expression
        assert expression.count("{") == expression.count("}"), expression


def query_id(expression: str) -> str:
    """A test id: the first metric the query names."""
    match = _NAME.search(expression)
    return match[0] if match else expression[:40]


@pytest.mark.parametrize("expression", queries(load()), ids=query_id)
def test_every_metric_a_query_names_exists_with_the_labels_it_uses(expression: str) -> None:
    named = [(match[1], spec_of(match[1], match[2])) for match in _NAME.finditer(expression)]
    assert named, f"a query charting no kvray metric: {expression}"
    allowed = {"__name__"}.union(*(labels_of(prefix, spec) for prefix, spec in named))
    used: set[str] = set()
    for matchers in _MATCHERS.findall(expression):
        used.update(_MATCHER_LABEL.findall(matchers))
    for grouping in _GROUPING.findall(expression):
        used.update(label.strip() for label in grouping.split(",") if label.strip())
    assert used <= allowed, f"labels {sorted(used - allowed)} are on none of its metrics: {expression}"


def test_every_operator_metric_is_charted_from_each_source() -> None:
    charted: dict[str, set[str]] = {RAY_AGENT: set(), VLLM: set(), SERVE_LLM: set()}
    for expression in queries(load()):
        for match in _NAME.finditer(expression):
            charted[match[1]].add(spec_of(match[1], match[2]).name)
    operator = {spec.name for spec in OPERATOR_METRICS}
    for prefix, names in charted.items():
        assert operator <= names, f"{prefix}: not charted: {sorted(operator - names)}"
