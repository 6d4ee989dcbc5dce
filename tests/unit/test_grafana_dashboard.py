"""The Grafana dashboard (docs/grafana) asks only for metrics the daemons and serve export."""

import json
import re
from pathlib import Path

from pgcascade.core import metrics
from pgcascade.monitor.exporter import FAMILIES

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pgcascade-dashboard.json"


def exported_series() -> set[str]:
    names = set()
    for attr in dir(metrics):
        collector = getattr(metrics, attr)
        if attr.isupper() and hasattr(collector, "describe"):
            for family in collector.describe():
                if family.type == "counter":
                    names.add(family.name + "_total")
                elif family.type == "histogram":
                    names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
                else:
                    names.add(family.name)
    return names | set(FAMILIES)  # read from the databases at scrape (all gauges)


def test_every_panel_queries_exported_metrics_with_their_labels():
    dash = json.loads(DASHBOARD.read_text())
    series = exported_series()
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bpgcascade_[a-z_]+", target["expr"]):
                assert name in series, f"panel {panel['title']!r} asks for {name}, which no daemon exports"
                used.add(name)
    # the lag, the throughput and the errors are on the board
    assert {"pgcascade_lag_seconds", "pgcascade_events_total", "pgcascade_errors_total"} <= used
    assert {"pgcascade_table_lag_seconds", "pgcascade_copy_rows", "pgcascade_copy_eta_seconds"} <= used
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
