"""Machine-readable state of a node and its set: what `status --json`, `members --json` and
`tables --json` print, and what `status --check` judges.

The schemas are documented in docs/monitoring.md and versioned by `SCHEMA_VERSION`: a field is
never renamed or given another meaning within a version; new fields may appear.  Times are
seconds (floats), timestamps ISO 8601 in UTC, connection strings have their passwords hidden.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg

from pgcascade.capture import ddl, logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade import survey
from pgcascade.core import pgconn
from pgcascade.core.daemonlock import DaemonRole, DaemonState, daemon_state
from pgcascade.core.errors import db_error_line, redact
from pgcascade.core.pgconn import scalar
from pgcascade.monitor import copies
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import conflicts
from pgcascade.replica import tables as subscriber
from pgcascade.replica.state import Phase

SCHEMA_VERSION = 1


def seconds(td: timedelta | None) -> float | None:
    return None if td is None else round(td.total_seconds(), 3)


def timestamp(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def human(s: float | None) -> str:
    """A length of time for people: 340 ms, 12.5 s, 2.0 min, 1.5 h."""
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


@dataclass
class Lag:
    seconds: float | None  # age on the provider of the last tick applied here
    ticks_behind: int | None
    provider_reachable: bool
    provider_error: str | None = None


def provider_connection(conn: psycopg.Connection, node: nodes.Node) -> psycopg.Connection:
    return pgconn.connect(nodes.provider_location(conn, node), autocommit=True, connect_timeout=5)


def lag_on(prov: psycopg.Connection, node: nodes.Node) -> Lag:
    if node.last_tick is None:
        return Lag(None, None, True)
    newest = q.last_tick_id(prov, node.queue_name)
    behind = None if newest is None else max(newest - node.last_tick, 0)
    return Lag(seconds(q.tick_age(prov, node.queue_name, node.last_tick)), behind, True)


def applied_position(t: subscriber.SubscriberTable, node: nodes.Node) -> int | None:
    """The tick up to which this table's changes are applied here: the copy consumer's
    while the copy process replays it, the node's once the worker does; None while copying."""
    phase = t.state.phase
    if phase is Phase.IN_COPY or phase is Phase.NEW:
        return None
    if phase is Phase.OK:
        return node.last_tick
    return t.copy_tick


def beyond_delay(lag: float | None, delay: timedelta | None) -> float | None:
    """A delayed leaf's lag beyond its apply_delay (what to watch); the lag itself otherwise."""
    if lag is None or not delay:
        return lag
    return round(max(lag - delay.total_seconds(), 0.0), 3)


def table_lags(
    prov: psycopg.Connection, node: nodes.Node, tables: list[subscriber.SubscriberTable]
) -> dict[str, tuple[float | None, int | None]]:
    """Per table: (seconds since its oldest change not applied here - 0 when none waits,
    events waiting), read from the provider's queue; (None, None) while copying."""
    by_tick: dict[int, list[str]] = {}
    for t in tables:
        tick = applied_position(t, node)
        if tick is not None:
            by_tick.setdefault(tick, []).append(t.table_name)
    now = scalar(prov, "select now()")
    out: dict[str, tuple[float | None, int | None]] = {t.table_name: (None, None) for t in tables}
    for tick, names in by_tick.items():
        try:
            pending = q.pending_by_table(prov, node.queue_name, tick)
        except psycopg.errors.NoDataFound:  # the tick rotated away: the worker fails louder
            continue
        except psycopg.errors.UndefinedFunction:  # a provider not upgraded yet (docs/operations.md)
            break
        for name in names:
            p = pending.get(name)
            out[name] = (0.0, 0) if p is None else (seconds(now - p.oldest), p.events)
    return out


def table_rows(
    conn: psycopg.Connection, node: nodes.Node, prov: psycopg.Connection | None = None
) -> list[dict[str, Any]]:
    """The node's tables: captured ones on the root, replicated ones (with state, and their
    lag when the provider answers) elsewhere."""
    if node.role.captures_changes:
        return [
            {"table": t, "key": keys, "format": fmt}
            for t, keys, fmt in set_tables.set_table_rows(conn, node.queue_name)
        ]
    tables = subscriber.tables(conn, node.queue_name)
    lags = table_lags(prov, node, tables) if prov is not None else {}
    failed = subscriber.copy_errors(conn, node.queue_name)
    return [
        {
            "table": t.table_name,
            "dest": t.dest_table,
            "key": t.key_columns,
            "where": t.row_filter,
            "columns": t.column_list,
            "state": str(t.state),
            "phase": t.state.phase.value,
            "tick": t.state.tick,
            "lag_seconds": lags.get(t.table_name, (None, None))[0],
            "pending_events": lags.get(t.table_name, (None, None))[1],
            "last_error": failed[t.table_name][0] if t.table_name in failed else None,
            "last_error_time": timestamp(failed[t.table_name][1]) if t.table_name in failed else None,
        }
        for t in tables
    ]


def tables_report(conn: psycopg.Connection, node: nodes.Node) -> list[dict[str, Any]]:
    """`tables --json`: table_rows with each table's lag when the provider answers."""
    if not node.role.reads_provider_queue:
        return table_rows(conn, node)
    try:
        prov = provider_connection(conn, node)
    except psycopg.Error:
        return table_rows(conn, node)
    with prov:
        return table_rows(conn, node, prov)


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
    with contextlib.ExitStack() as stack:
        prov = None
        if node.role.reads_provider_queue:
            try:
                prov = stack.enter_context(provider_connection(conn, node))
                lag = lag_on(prov, node)
            except psycopg.Error as e:
                prov, lag = None, Lag(None, None, False, db_error_line(e))
            report["lag_seconds"] = lag.seconds
            report["apply_delay_seconds"] = seconds(node.apply_delay)
            report["lag_beyond_delay_seconds"] = beyond_delay(lag.seconds, node.apply_delay)
            report["ticks_behind"] = lag.ticks_behind
            report["provider_reachable"] = lag.provider_reachable
            report["provider_error"] = lag.provider_error
        report["daemons"] = daemons_report(conn, node)
        if node.role.captures_changes:
            report["capture"] = capture_report(conn, node.queue_name)
            report["auto_ddl"] = auto_ddl_report(conn, node.queue_name)
        else:
            report["takes_new_tables"] = node.all_tables
        if node.role.has_queue:
            report["queue"] = queue_report(conn, node.queue_name)
        if node.role.is_root:
            report["peers"] = peers_report(conn, node.queue_name)
        tables = table_rows(conn, node, prov)
        report["tables"] = tables
        per_state: dict[str, int] = {}
        for t in tables:
            per_state[t.get("state", "captured")] = per_state.get(t.get("state", "captured"), 0) + 1
        report["tables_per_state"] = per_state
        report["copies"] = [
            copies.copy_progress(conn, prov, node.queue_name, t)
            for t in subscriber.tables(conn, node.queue_name)
            if t.state.phase is Phase.IN_COPY
        ]
    return report


def peers_report(conn: psycopg.Connection, own_queue: str) -> list[dict[str, Any]]:
    """A two-way master: per peer, how far behind its queue this master is, and the conflicts."""
    out = []
    for p in nodes.peers(conn, own_queue):
        try:
            with provider_connection(conn, p) as prov:
                lag = lag_on(prov, p)
        except psycopg.Error as e:
            lag = Lag(None, None, False, db_error_line(e))
        error = nodes.last_error(conn, p.queue_name)
        out.append(
            {
                "peer": p.provider_node,
                "queue": p.queue_name,
                "policy": p.conflict_policy,
                "lag_seconds": lag.seconds,
                "ticks_behind": lag.ticks_behind,
                "reachable": lag.provider_reachable,
                "conflicts": conflicts.conflict_count(conn, p.queue_name),
                "last_error": error[0] if error else None,
            }
        )
    return out


def queue_report(conn: psycopg.Connection, queue: str) -> dict[str, Any]:
    """The node's own queue: its newest tick and what it keeps for the slowest subscriber."""
    out: dict[str, Any] = {
        "last_tick": q.last_tick_id(conn, queue),
        "retained_events": None,
        "retained_bytes": None,
        "oldest_tick_age_seconds": None,
    }
    try:
        r = q.retained(conn, queue)
    except psycopg.errors.UndefinedFunction:  # a node not upgraded yet (docs/operations.md)
        return out
    out["retained_events"], out["retained_bytes"] = r.events, r.bytes
    if r.oldest_tick_time is not None:
        out["oldest_tick_age_seconds"] = seconds(scalar(conn, "select now()") - r.oldest_tick_time)
    return out


def auto_ddl_report(conn: psycopg.Connection, queue: str) -> dict[str, Any]:
    """Whether the root captures its DDL (auto-ddl), and adds its new tables."""
    setting = ddl.setting(conn, queue)
    return {
        "on": setting is not None,
        "add_new_tables": setting is not None and setting.add_new_tables,
        "event_triggers": ddl.triggers_ok(conn),
    }


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
        "slot_problem": logical.slot_problem(conn, queue),
    }


def daemons_report(conn: psycopg.Connection, node: nodes.Node) -> list[dict[str, Any]]:
    """The node's daemons, each running (its lock held) or when it was last seen, and whether
    its absence is critical: the worker of a subscriber (or of a master with peers), the
    capture daemon of a logical root, and a ticker that ran here (a root may be ticked by
    pgqd instead; a root's worker without peers has nothing to do)."""
    worker_needed = node.role.reads_provider_queue or (
        node.role.is_root and bool(nodes.peers(conn, node.queue_name))
    )
    wanted = [(daemon_state(conn, DaemonRole.WORKER, node.queue_name), worker_needed)]
    if node.role.has_queue:
        ticker = daemon_state(conn, DaemonRole.TICKER, "")
        wanted.append((ticker, ticker.seen))
    if node.role.is_root and logical.is_logical(conn, node.queue_name):
        wanted.append((daemon_state(conn, DaemonRole.CAPTURE, node.queue_name), True))
    return [daemon_entry(state, needed) for state, needed in wanted]


def daemon_entry(d: DaemonState, needed: bool) -> dict[str, Any]:
    return {
        "role": d.role.value,
        "running": d.running,
        "critical": needed and not d.running,
        "job": d.job_name,
        "host": d.host,
        "pid": d.pid,
        "started": timestamp(d.started),
        "last_seen": timestamp(d.heartbeat),
        "last_seen_seconds": seconds(d.since_heartbeat),
        "stopped": timestamp(d.stopped),
    }


def daemon_line(d: dict[str, Any]) -> str:
    """One daemon in words: 'worker not running (last seen 2.0 min ago, pid 7 on db2, stopped)'."""
    if d["running"]:
        return (
            f"{d['role']} running, pid {d['pid']} on {d['host']} (job {d['job']}),"
            f" last loop {human(d['last_seen_seconds'])} ago"
        )
    if d["last_seen"] is None:
        return f"{d['role']} not running (never started here)"
    how = "stopped" if d["stopped"] else "did not stop cleanly"
    return f"{d['role']} not running (last seen {human(d['last_seen_seconds'])} ago, pid {d['pid']} on {d['host']}, {how})"


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
    """`status --check`: critical when a daemon the node needs is not running, the lag (a
    delayed leaf's beyond its delay) is over `max_lag` or unknown, the provider does not answer,
    or the node or a table's copy has an error; ok otherwise (a root: its daemons, its error and
    capture only)."""
    problems = [daemon_line(d) for d in report.get("daemons", []) if d["critical"]]
    delay = report.get("apply_delay_seconds")
    beyond = f" beyond the {delay:g} s apply delay" if delay else ""
    if report.get("last_error"):
        problems.append(f"error: {report['last_error']}")
    failed_copies: dict[str, list[str]] = {}  # the same failure of several copies: said once
    for t in report.get("tables", []):
        if t.get("last_error") and t["last_error"] != report.get("last_error"):
            failed_copies.setdefault(t["last_error"], []).append(t["table"])
    problems += [f"copy of {', '.join(names)}: {error}" for error, names in failed_copies.items()]
    if "lag_seconds" in report:
        lag = report.get("lag_beyond_delay_seconds", report["lag_seconds"])
        if not report["provider_reachable"]:
            problems.append(f"provider {report['provider']} unreachable")
        elif max_lag is not None and (lag is None or lag > max_lag):
            problems.append(f"lag {'unknown' if lag is None else f'{lag:.1f} s'}{beyond} over {max_lag:g} s")
    capture = report.get("capture", {})
    if capture.get("slot_problem"):
        problems.append(f"capture: {capture['slot_problem']}")
    elif capture.get("last_error"):
        problems.append(f"capture error: {capture['last_error']}")
    who = f"{report['node']} ({report['type']})"
    if problems:
        return Verdict(2, f"CRITICAL {who}: " + "; ".join(problems))
    lag_text = f", lag {report['lag_seconds']:.1f} s" if report.get("lag_seconds") is not None else ""
    if delay and report.get("lag_beyond_delay_seconds") is not None:
        lag_text += f" ({report['lag_beyond_delay_seconds']:.1f} s{beyond})"
    return Verdict(0, f"OK {who}{lag_text}")
