#!/usr/bin/env python3
"""What monitoring costs the provider: lag per table (`pgcascade.pending_by_table`) against the
consumer-level lag PgQ users already read (`get_consumer_info`, the same on pgcascade's queue),
at growing backlogs; and `status --json` / one `serve` reading of a root and a leaf.

No peer shows lag per table, so the comparison is with the consumer-level figure every
PgQ/Londiste tool reads: the ratio says what the per-table view costs on top of it.

One throwaway cluster; the root and the leaf are two databases of it.  The leaf is paused and
`pgbench -N` makes the backlog (2 row events per transaction).  Each query is timed as the
median of 5 calls, from a warm connection.

    .venv/bin/python bench/monitor_cost.py [--backlogs 10000,100000,500000]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from pgcascade.dev.localcluster import new_cluster, pg_bindir

QUEUE = "bench"


def median_ms(conn: psycopg.Connection, query: str, params: tuple) -> float:
    times = []
    for _ in range(5):
        t = time.perf_counter()
        conn.execute(query, params).fetchall()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def cli(*args: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pgcascade", *args], check=True, capture_output=True)
    return (time.perf_counter() - t) * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backlogs", default="10000,100000,500000", help="transactions of backlog, ascending")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgcascade-monbench-"))
    cluster = new_cluster("mon", basedir=work)
    try:
        root, leaf = cluster.create_database("root"), cluster.create_database("leaf")
        pgbench = str(pg_bindir() / "pgbench")
        subprocess.run([pgbench, "-i", "-q", "-n", root], check=True, capture_output=True)
        with psycopg.connect(root, autocommit=True) as c:
            c.execute("alter table pgbench_history add column hid bigserial primary key")
        ini = {}
        for name, db in (("root", root), ("leaf", leaf)):
            ini[name] = work / f"{name}.ini"
            ini[name].write_text(f"[pgcascade]\njob_name = {name}\ndb = {db}\nqueue_name = {QUEUE}\n")
        cli(str(ini["root"]), "create-root", "root")
        cli(str(ini["root"]), "add-table", "--all")
        cli(str(ini["leaf"]), "create-leaf", "leaf", "--provider", root)
        cli(str(ini["leaf"]), "add-table", "--all", "--create")
        with psycopg.connect(leaf, autocommit=True) as c:
            # the tables as if copied, so every one is ok at the leaf's tick: no worker needed
            c.execute("update pgcascade.subscriber_table set state = 'ok'")
        with psycopg.connect(root, autocommit=True) as prov:
            prov.execute("select pgcascade.ticker(%s)", (QUEUE,))
            consumer = prov.execute(
                "select consumer_name, last_tick from pgcascade.get_consumer_info(%s)", (QUEUE,)
            ).fetchone()
            name, tick = consumer
            with psycopg.connect(leaf, autocommit=True) as c:
                c.execute("update pgcascade.node set last_tick = %s where queue_name = %s", (tick, QUEUE))
            made = 0
            print(
                f"{'backlog events':>15} {'per table ms':>13} {'consumer ms':>12} {'ratio':>7} "
                f"{'status --json ms':>17}"
            )
            for target in (int(x) for x in args.backlogs.split(",")):
                subprocess.run(
                    [pgbench, "-n", "-N", "-c", "2", "-j", "2", "-t", str((target - made) // 2), root],
                    check=True,
                    capture_output=True,
                )
                made = target
                prov.execute("select pgcascade.ticker(%s)", (QUEUE,))
                events = prov.execute(
                    "select sum(events) from pgcascade.pending_by_table(%s, %s)", (QUEUE, tick)
                ).fetchone()[0]
                per_table = median_ms(prov, "select * from pgcascade.pending_by_table(%s, %s)", (QUEUE, tick))
                per_consumer = median_ms(
                    prov, "select * from pgcascade.get_consumer_info(%s, %s)", (QUEUE, name)
                )
                status = statistics.median(cli(str(ini["leaf"]), "status", "--json") for _ in range(3))
                print(
                    f"{events:>15,} {per_table:>13.1f} {per_consumer:>12.2f} {per_table / per_consumer:>7.0f}x "
                    f"{status:>17.0f}"
                )
    finally:
        cluster.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
