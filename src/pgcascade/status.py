"""What `status` prints: queues and consumers with their lag, as rich tables."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from rich.console import Console, Group
from rich.table import Table

from pgcascade import queue as q


def fmt_interval(td: timedelta | None) -> str:
    if td is None:
        return "-"
    s = td.total_seconds()
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def queue_tables(conn: psycopg.Connection) -> Group:
    queues = Table(title="queues", title_justify="left")
    for col in ("queue", "last tick", "ticker lag", "events waiting", "events/s", "table", "consumers"):
        queues.add_column(col, justify="left" if col == "queue" else "right")
    for r in q.queue_info(conn):
        flags = (
            " (paused)"
            if r["queue_ticker_paused"]
            else " (external ticks)"
            if r["queue_external_ticker"]
            else ""
        )
        queues.add_row(
            r["queue_name"] + flags,
            str(r["last_tick_id"]),
            fmt_interval(r["ticker_lag"]),
            str(r["ev_new"]),
            f"{r['ev_per_sec']:.0f}" if r["ev_per_sec"] is not None else "-",
            f"{r['queue_cur_table'] + 1}/{r['queue_ntables']}",
            str(r["consumers"]),
        )
    consumers = Table(title="consumers", title_justify="left")
    for col in ("queue", "consumer", "lag", "last seen", "last tick", "open batch", "pending events"):
        consumers.add_column(col, justify="left" if col in ("queue", "consumer") else "right")
    for r in q.consumer_info(conn):
        consumers.add_row(
            r["queue_name"],
            r["consumer_name"],
            fmt_interval(r["lag"]),
            fmt_interval(r["last_seen"]),
            str(r["last_tick"]),
            str(r["current_batch"] or "-"),
            str(r["pending_events"]),
        )
    return Group(queues, consumers)


def print_queue_status(conn: psycopg.Connection) -> None:
    Console().print(queue_tables(conn))
