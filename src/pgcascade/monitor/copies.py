"""Progress of the initial copies running on a subscriber: rows done and to do, rate and ETA,
per table and, for a Spark copy, per key range in flight.

A streaming copy is one COPY FROM in one transaction: PostgreSQL itself counts its rows
(pg_stat_progress_copy), so the copy process writes nothing for us and a killed copy shows no
stale figure.  A Spark copy adds the ranges already committed (the pipeline's copy plan) to the
COPYs in flight, each named by its range in application_name.  The total is the provider's
row estimate, so a percentage or an ETA is an estimate too; None when the provider's table was
never analysed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg

from pgcascade.core import catalog
from pgcascade.replica import tables as subscriber


@dataclass(frozen=True)
class InFlight:
    range_no: int | None  # None: a streaming copy (one COPY for the table)
    rows: int
    bytes: int
    seconds: float  # since its transaction began


def in_flight(sub: psycopg.Connection, dest_table: str) -> list[InFlight]:
    """The COPY FROM commands loading `dest_table` now, as PostgreSQL counts them."""
    rows = sub.execute(
        "select a.application_name, p.tuples_processed, p.bytes_processed,"
        " extract(epoch from now() - a.xact_start)::float8"
        " from pg_stat_progress_copy p join pg_stat_activity a on a.pid = p.pid"
        " where p.command = 'COPY FROM' and p.relid = to_regclass(%s) and p.datname = current_database()",
        (dest_table,),
    ).fetchall()
    from pgcascade.pipeline.copy import RANGE_APP_PREFIX  # here: `status` need not load the copy's modules

    prefix = re.compile(re.escape(RANGE_APP_PREFIX) + r"(\d+)$")
    out = []
    for app, tuples, nbytes, secs in rows:
        m = prefix.match(app or "")
        out.append(InFlight(int(m.group(1)) if m else None, tuples, nbytes, float(secs or 0)))
    return out


def building_indexes(sub: psycopg.Connection, dest_table: str) -> bool:
    return bool(
        sub.execute(
            "select exists (select 1 from pg_stat_progress_create_index where relid = to_regclass(%s))",
            (dest_table,),
        ).fetchone()[0]  # type: ignore[index]
    )


def eta(remaining: int | None, rate: float) -> float | None:
    if remaining is None or rate <= 0:
        return None
    return round(max(remaining, 0) / rate, 1)


def copy_progress(
    sub: psycopg.Connection, prov: psycopg.Connection | None, queue: str, st: subscriber.SubscriberTable
) -> dict[str, Any]:
    """One in-copy table's progress, JSON-ready (docs/monitoring.md, `copies`)."""
    from pgcascade.pipeline.copy import progress as plan_progress  # only while a table copies

    flights = in_flight(sub, st.dest_table)
    plans = [p for p in plan_progress(sub, queue, st.table_name) if not p["finished"]]
    if plans:
        return spark_progress(plans[0], flights, st)
    total = catalog.estimated_rows(prov, st.table_name) if prov is not None else None
    rows = sum(f.rows for f in flights)
    secs = max((f.seconds for f in flights), default=0.0)
    rate = rows / secs if secs > 0 else 0.0
    step = "copying" if flights else "indexes" if building_indexes(sub, st.dest_table) else "starting"
    return {
        "table": st.table_name,
        "method": "stream",
        "step": step,
        "attempt": None,
        "finished": False,
        "ranges_done": None,
        "ranges": None,
        "rows": rows,
        "rows_total": total,
        "percent": percent(rows, total),
        "bytes": sum(f.bytes for f in flights),
        "mb_per_s": round(sum(f.bytes for f in flights) / secs / 1e6, 2) if secs > 0 else 0.0,
        "rows_per_s": round(rate, 1),
        "eta": eta(None if total is None else total - rows, rate) if flights else None,
        "ranges_in_flight": [],
    }


def spark_progress(plan: dict[str, Any], flights: list[InFlight], st: subscriber.SubscriberTable) -> dict:
    total = plan["rows_total"]
    per_range = total // plan["ranges"] if total is not None and plan["ranges"] else None
    ranges = []
    for f in sorted((f for f in flights if f.range_no is not None), key=lambda f: f.range_no or 0):
        rate = f.rows / f.seconds if f.seconds > 0 else 0.0
        ranges.append(
            {
                "range": f.range_no,
                "rows": f.rows,
                "rows_total": per_range,
                "seconds": round(f.seconds, 1),
                "eta": eta(None if per_range is None else per_range - f.rows, rate),
            }
        )
    rows = plan["rows"] + sum(f.rows for f in flights)
    rate = plan["rows_per_s"] + sum(f.rows / f.seconds for f in flights if f.seconds > 0)
    return {
        **plan,
        "method": "spark",
        "step": "copying" if plan["ranges_done"] < plan["ranges"] else "indexes",
        "rows": rows,
        "percent": percent(rows, total),
        "rows_per_s": round(rate, 1),
        "eta": eta(None if total is None else total - rows, rate),
        "ranges_in_flight": ranges,
    }


def percent(rows: int, total: int | None) -> float | None:
    if not total:
        return None
    return round(min(100.0, 100.0 * rows / total), 1)
