"""Machine-readable state of a node and its set: what `status --json`, `members --json` and
`tables --json` print, and what `status --check` judges.

The schemas are documented in docs/monitoring.md and versioned by `SCHEMA_VERSION`: a field is
never renamed or given another meaning within a version; new fields may appear.  Times are
seconds (floats), timestamps ISO 8601 in UTC, connection strings have their passwords hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade import survey
from pgcascade.core import pgconn
from pgcascade.core.errors import db_error_line, redact
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pipeline.copy import progress
from pgcascade.replica import tables as subscriber

SCHEMA_VERSION = 1


def seconds(td: timedelta | None) -> float | None:
    return None if td is None else round(td.total_seconds(), 3)


def timestamp(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


@dataclass
class Lag:
    seconds: float | None  # age on the provider of the last tick applied here
    ticks_behind: int | None
    provider_reachable: bool
    provider_error: str | None = None


def subscriber_lag(conn: psycopg.Connection, node: nodes.Node) -> Lag:
    """How far this subscriber is behind its provider, read from the provider."""
    try:
        prov = pgconn.connect(nodes.provider_location(conn, node), autocommit=True, connect_timeout=5)
    except psycopg.Error as e:
        return Lag(None, None, False, db_error_line(e))
    with prov:
        if node.last_tick is None:
            return Lag(None, None, True)
        newest = q.last_tick_id(prov, node.queue_name)
        behind = None if newest is None else max(newest - node.last_tick, 0)
        return Lag(seconds(q.tick_age(prov, node.queue_name, node.last_tick)), behind, True)


def table_rows(conn: psycopg.Connection, node: nodes.Node) -> list[dict[str, Any]]:
    """The node's tables: captured ones on the root, replicated ones (with state) elsewhere."""
    if node.role.captures_changes:
        return [
            {"table": t, "key": keys, "format": fmt}
            for t, keys, fmt in set_tables.set_table_rows(conn, node.queue_name)
        ]
    return [
        {
            "table": t.table_name,
            "dest": t.dest_table,
            "key": t.key_columns,
            "state": str(t.state),
            "phase": t.state.phase.value,
            "tick": t.state.tick,
        }
        for t in subscriber.tables(conn, node.queue_name)
    ]


def node_report(conn: psycopg.Connection, node: nodes.Node) -> dict[str, Any]:
    """Everything `status` shows of this node, as one JSON-ready dict."""
    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "set": node.queue_name,
        "node": node.node_name,
        "type": node.node_type.value,
        "provider": node.provider_node,
        "paused": node.paused,
        "last_tick": node.last_tick,
        "last_error": None,
        "last_error_time": None,
    }
    error = nodes.last_error(conn, node.queue_name)
    if error:
        report["last_error"], report["last_error_time"] = error[0], timestamp(error[1])
    if node.role.reads_provider_queue:
        lag = subscriber_lag(conn, node)
        report["lag_seconds"] = lag.seconds
        report["ticks_behind"] = lag.ticks_behind
        report["provider_reachable"] = lag.provider_reachable
        report["provider_error"] = lag.provider_error
    if node.role.captures_changes:
        report["capture"] = capture_report(conn, node.queue_name)
    tables = table_rows(conn, node)
    report["tables"] = tables
    per_state: dict[str, int] = {}
    for t in tables:
        per_state[t.get("state", "captured")] = per_state.get(t.get("state", "captured"), 0) + 1
    report["tables_per_state"] = per_state
    report["copies"] = [p for p in progress(conn, node.queue_name) if not p["finished"]]
    return report


def capture_report(conn: psycopg.Connection, queue: str) -> dict[str, Any]:
    row = logical.capture_status(conn, queue)
    if row is None:
        return {"mode": "trigger"}
    slot, exists, active, retained, behind, wal_status, since_commit, since_capture, error, error_time = row
    return {
        "mode": "logical",
        "slot": slot,
        "slot_exists": exists,
        "slot_active": active,
        "wal_retained_bytes": retained,
        "wal_not_captured_bytes": behind,
        "wal_status": wal_status,
        "since_last_captured_commit_seconds": seconds(since_commit),
        "since_daemon_wrote_seconds": seconds(since_capture),
        "last_error": error,
        "last_error_time": timestamp(error_time),
    }


def members_report(conn: psycopg.Connection, queue: str) -> list[dict[str, Any]]:
    """Every node this node knows, each read from its own database when it answers."""
    return [
        {
            "name": m.name,
            "type": m.node.node_type.value if m.node else None,
            "provider": m.node.provider_node if m.node else None,
            "location": redact(m.location),
            "reachable": m.node is not None,
            "dead": m.dead,
            "error": m.error,
        }
        for m in survey.survey(conn, queue)
    ]


@dataclass
class Verdict:
    code: int  # 0 ok, 2 critical (the monitoring plugin convention)
    line: str


def check(report: dict[str, Any], max_lag: float | None) -> Verdict:
    """`status --check`: critical when the lag is over `max_lag` or unknown, the provider does
    not answer, or the node has an error; ok otherwise (a root: its error and capture only)."""
    problems = []
    if report.get("last_error"):
        problems.append(f"error: {report['last_error']}")
    if "lag_seconds" in report:
        lag = report["lag_seconds"]
        if not report["provider_reachable"]:
            problems.append(f"provider {report['provider']} unreachable")
        elif max_lag is not None and (lag is None or lag > max_lag):
            problems.append(f"lag {'unknown' if lag is None else f'{lag:.1f} s'} over {max_lag:g} s")
    capture = report.get("capture", {})
    if capture.get("last_error"):
        problems.append(f"capture error: {capture['last_error']}")
    who = f"{report['node']} ({report['type']})"
    if problems:
        return Verdict(2, f"CRITICAL {who}: " + "; ".join(problems))
    lag_text = f", lag {report['lag_seconds']:.1f} s" if report.get("lag_seconds") is not None else ""
    return Verdict(0, f"OK {who}{lag_text}")
