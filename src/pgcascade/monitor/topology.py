"""The whole set as one JSON document: every member, read from its own database, with the
report `status --json` gives of it.  What `serve` shows and exports (`/api/topology`).

Members come from the node `serve` was started on (the locations the root sends to every
node), so the page follows a switchover or a failover: the next refresh reads the new tree.
Locations are shown with their passwords hidden; a member that does not answer is listed with
its one-line error instead of a report.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg

from pgcascade.cascade import survey
from pgcascade.core import pgconn
from pgcascade.core.errors import db_error_line, redact
from pgcascade.monitor import report
from pgcascade.pgq import node as nodes


def member_entry(m: survey.Member, queue: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": m.name,
        "type": m.node.node_type.value if m.node else None,
        "provider": m.node.provider_node if m.node else None,
        "location": redact(m.location),
        "reachable": m.node is not None,
        "dead": m.dead,
        "error": m.error,
        "report": None,
    }
    if m.node is None:
        return entry
    try:
        with pgconn.connect(m.location, autocommit=True, connect_timeout=3) as conn:
            node = nodes.require_node(conn, queue)
            entry["report"] = report.node_report(conn, node)
    except psycopg.Error as e:
        entry["reachable"], entry["error"] = False, db_error_line(e)
    return entry


def topology(conn: psycopg.Connection, queue: str) -> dict[str, Any]:
    """The set seen from `conn`'s node: members (tree order: root first), their reports, and the
    errors of the set gathered in one list, newest first."""
    members = [member_entry(m, queue) for m in survey.survey(conn, queue)]
    members.sort(key=lambda e: (e["type"] != "root", e["name"]))
    return {
        "schema": report.SCHEMA_VERSION,
        "set": queue,
        "generated_at": datetime.now(UTC).isoformat(),
        "nodes": members,
        "errors": errors(members),
    }


def errors(members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Unreachable members, needed daemons that do not run, worker, copy and capture errors,
    newest first."""
    out = []
    for m in members:
        r = m["report"]
        if not m["reachable"] and not m["dead"]:
            out.append({"node": m["name"], "kind": "unreachable", "message": m["error"], "time": None})
        if r is None:
            continue
        for d in r.get("daemons", []):
            if d["critical"]:
                out.append(
                    {
                        "node": m["name"],
                        "kind": d["role"],
                        "message": report.daemon_line(d),
                        "time": d["last_seen"],
                    }
                )
        if r.get("last_error"):
            out.append(
                {
                    "node": m["name"],
                    "kind": "worker",
                    "message": r["last_error"],
                    "time": r["last_error_time"],
                }
            )
        for t in r.get("tables", []):
            if t.get("last_error"):
                out.append(
                    {
                        "node": m["name"],
                        "kind": f"copy {t['table']}",
                        "message": t["last_error"],
                        "time": t["last_error_time"],
                    }
                )
        if r.get("provider_reachable") is False:
            out.append({"node": m["name"], "kind": "provider", "message": r["provider_error"], "time": None})
        capture = r.get("capture") or {}
        if capture.get("slot_problem") or capture.get("last_error"):
            out.append(
                {
                    "node": m["name"],
                    "kind": "capture",
                    "message": capture.get("slot_problem") or capture["last_error"],
                    "time": capture["last_error_time"],
                }
            )
    return sorted(out, key=lambda e: e["time"] or "", reverse=True)
