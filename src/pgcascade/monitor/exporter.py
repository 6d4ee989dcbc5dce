"""Metrics read from the databases when Prometheus scrapes, not counted by a daemon: lag per
table, copy progress per table and per Spark range, the queue's retained size, the logical
slot's retained WAL - and, for `serve`, every node's lag and state.

Two collectors build them from the same reports `status --json` prints (monitor/report.py):
`NodeCollector`, which the worker's /metrics registers for its own node, and `SetCollector`,
which `serve` exports for the whole set from its cached topology.  Names and labels are in
docs/reference.md (generated from `FAMILIES`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pgcascade.core import pgconn
from pgcascade.monitor import report
from pgcascade.pgq import node as nodes

log = logging.getLogger("pgcascade")

NODE = ["set", "node"]
TABLE = [*NODE, "table"]

# name -> (help, labels); the reference page lists them with the daemons' own metrics
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "pgcascade_table_lag_seconds": (
        "age of the oldest change of the table not applied here (0: none waits); absent while copying",
        TABLE,
    ),
    "pgcascade_table_pending_events": ("row events of the table not applied here yet", TABLE),
    "pgcascade_copy_rows": ("rows copied so far by the table's initial copy", TABLE),
    "pgcascade_copy_rows_estimated": ("rows the initial copy should copy (the provider's estimate)", TABLE),
    "pgcascade_copy_rows_per_second": ("rate of the initial copy", TABLE),
    "pgcascade_copy_eta_seconds": ("time the initial copy still needs at its current rate", TABLE),
    "pgcascade_copy_ranges": ("key ranges of a Spark copy", TABLE),
    "pgcascade_copy_ranges_done": ("key ranges of a Spark copy committed", TABLE),
    "pgcascade_copy_range_rows": ("rows copied so far by a Spark range in flight", [*TABLE, "range"]),
    "pgcascade_copy_range_eta_seconds": ("time a Spark range in flight still needs", [*TABLE, "range"]),
    "pgcascade_queue_retained_events": ("events the node's queue keeps for its slowest subscriber", NODE),
    "pgcascade_queue_retained_bytes": ("size on disk of the node's queue", NODE),
    "pgcascade_slot_wal_retained_bytes": ("WAL the logical capture slot retains", NODE),
    "pgcascade_slot_wal_not_captured_bytes": ("WAL written after the slot's last captured position", NODE),
    # set-wide, from serve only (the worker exports its own node's lag as it applies)
    "pgcascade_node_reachable": ("1 when serve could read the node's database", NODE),
    "pgcascade_node_paused": ("1 when the node's worker is paused", NODE),
    "pgcascade_node_has_error": ("1 when the node's worker recorded an error", NODE),
    "pgcascade_node_lag_seconds": ("age, on its provider, of the last tick the node applied", NODE),
    "pgcascade_node_lag_ticks": ("ticks the node's provider has that the node has not applied", NODE),
    "pgcascade_node_apply_delay_seconds": (
        "a subscriber's apply_delay (0: not delayed): its lag beyond the delay is lag minus this",
        NODE,
    ),
    "pgcascade_node_tables": ("tables of the node, by state", [*NODE, "phase"]),
    "pgcascade_node_daemon_running": (
        "1 while the node's daemon of that role holds its lock",
        [*NODE, "role"],
    ),
    "pgcascade_node_daemon_critical": (
        "1 when the node needs that daemon and it is not running",
        [*NODE, "role"],
    ),
    "pgcascade_node_daemon_last_seen_seconds": (
        "seconds since the daemon's last loop (its heartbeat)",
        [*NODE, "role"],
    ),
}
SET_WIDE = {n for n in FAMILIES if n.startswith("pgcascade_node_")}


class Families:
    """The metric families of one scrape, filled from reports."""

    def __init__(self, names: Iterable[str]):
        self.by_name = {n: GaugeMetricFamily(n, FAMILIES[n][0], labels=FAMILIES[n][1]) for n in names}

    def add(self, name: str, labels: list[str], value: float | int | None) -> None:
        if value is not None and name in self.by_name:
            self.by_name[name].add_metric(labels, float(value))

    def node(self, r: dict[str, Any]) -> None:
        """What one node's report holds, for the node-level families this scrape exports."""
        key = [r["set"], r["node"]]
        for t in r["tables"]:
            self.add("pgcascade_table_lag_seconds", [*key, t["table"]], t.get("lag_seconds"))
            self.add("pgcascade_table_pending_events", [*key, t["table"]], t.get("pending_events"))
        for c in r["copies"]:
            k = [*key, c["table"]]
            self.add("pgcascade_copy_rows", k, c["rows"])
            self.add("pgcascade_copy_rows_estimated", k, c["rows_total"])
            self.add("pgcascade_copy_rows_per_second", k, c["rows_per_s"])
            self.add("pgcascade_copy_eta_seconds", k, c["eta"])
            self.add("pgcascade_copy_ranges", k, c["ranges"])
            self.add("pgcascade_copy_ranges_done", k, c["ranges_done"])
            for f in c["ranges_in_flight"]:
                self.add("pgcascade_copy_range_rows", [*k, str(f["range"])], f["rows"])
                self.add("pgcascade_copy_range_eta_seconds", [*k, str(f["range"])], f["eta"])
        if "queue" in r:
            self.add("pgcascade_queue_retained_events", key, r["queue"]["retained_events"])
            self.add("pgcascade_queue_retained_bytes", key, r["queue"]["retained_bytes"])
        capture = r.get("capture") or {}
        self.add("pgcascade_slot_wal_retained_bytes", key, capture.get("wal_retained_bytes"))
        self.add("pgcascade_slot_wal_not_captured_bytes", key, capture.get("wal_not_captured_bytes"))
        self.add("pgcascade_node_paused", key, int(bool(r["paused"])))
        self.add("pgcascade_node_has_error", key, int(bool(r["last_error"])))
        self.add("pgcascade_node_lag_seconds", key, r.get("lag_seconds"))
        self.add("pgcascade_node_lag_ticks", key, r.get("ticks_behind"))
        if "lag_seconds" in r:
            self.add("pgcascade_node_apply_delay_seconds", key, r.get("apply_delay_seconds") or 0.0)
        for phase, n in r["tables_per_state"].items():
            self.add("pgcascade_node_tables", [*key, phase], n)
        for d in r.get("daemons", []):
            self.add("pgcascade_node_daemon_running", [*key, d["role"]], int(d["running"]))
            self.add("pgcascade_node_daemon_critical", [*key, d["role"]], int(d["critical"]))
            self.add("pgcascade_node_daemon_last_seen_seconds", [*key, d["role"]], d["last_seen_seconds"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self.by_name.values()


class NodeCollector(Collector):
    """The worker's own node, read at each scrape (one connection, closed after it)."""

    def __init__(self, dsn: str, queue: str):
        self.dsn, self.queue = dsn, queue

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []  # read the databases only when scraped, not when registered

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fams = Families(n for n in FAMILIES if n not in SET_WIDE)
        try:
            with pgconn.connect(self.dsn, autocommit=True, connect_timeout=3) as conn:
                node = nodes.get_node(conn, self.queue)
                if node is not None:
                    fams.node(report.node_report(conn, node))
        except psycopg.Error as e:  # the daemon's own gauges still go out; this scrape lacks these
            log.debug("metrics: cannot read the node: %s", e)
        yield from fams.collect()


class SetCollector(Collector):
    """Every node of the set, from the topology `serve` keeps (no database read at scrape)."""

    def __init__(self, current: Callable[[], dict[str, Any] | None]):
        self.current = current

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fams = Families(FAMILIES)
        topo = self.current()
        for m in (topo or {}).get("nodes", []):
            fams.add("pgcascade_node_reachable", [topo["set"], m["name"]], int(m["report"] is not None))  # type: ignore[index]
            if m["report"] is not None:
                fams.node(m["report"])
        yield from fams.collect()
