"""Prometheus for the tests: a live endpoint's samples, and the metric names the provisioned
Grafana dashboard (deploy/grafana) queries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]  # (name, labels) -> value

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
METRIC_NAME = re.compile(r"\bspool_[a-z_]+\b")
MEDIA_PREFIX = "spool_image_"  # the media worker's (tests/test_media.py checks those)


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/spool.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def dashboard_metrics() -> set[str]:
    """Every metric a query names, histograms by their ``_bucket`` series."""
    return {m for expr in dashboard_exprs() for m in METRIC_NAME.findall(expr)}


def scrape(url: str) -> Samples:
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
