#!/usr/bin/env python3
"""The provider's CPU for one fetch of a consumer that keeps up: `next_batch_events` alone.

A diagnostic for the change path's fixed cost on the provider (issue 25): one throwaway cluster
(fsync on), a queue, one consumer.  Each round a writer session commits `--events` events in
one transaction (`pgcascade.insert_event`, as a TPC-B transaction's capture would), then the
consumer's session asks for its next batch as a leaf worker does - finishing the last one,
making a tick on demand, the events inline - and the CPU time of the consumer's backend
(`/proc/PID/stat`) over `--calls` rounds is divided by them.  Nothing else runs, so the figure
moves far less from hour to hour than the path's; `--variant NAME=FILE.sql` measures the
functions of FILE.sql (an older 52_fetch.sql, say) in turn with the installed ones, interleaved.

    .venv/bin/python bench/fetch_cpu.py [--calls 3000] [--events 4] [--rounds 3]
                                        [--variant NAME=FILE.sql ...] [--callgrind]

`--callgrind` counts the consumer's backend's instructions instead (the server under valgrind,
as bench/capture_cpu.py runs it): a session of --calls rounds and one of twice as many, the
difference over --calls - the same to the last digit from run to run, where CPU time on this
machine moves by 10-15 % between rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_cpu import callgrind_server

from pgcascade.core import schema
from pgcascade.dev.localcluster import LocalCluster, new_cluster

TICK = os.sysconf("SC_CLK_TCK")
FETCH = (
    "select coalesce(batch_id, 0), length(events) from pgcascade.next_batch_events("
    "'q', 'c', %s, null, null, true, 10000, null, false)"
)
EVENT = "select pgcascade.insert_event('q', %s, %s, 'public.t', null, null, null)"
DATA = '{"aid":%d,"bid":1,"abalance":-4711,"filler":"                                        "}'


def backend_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def run(writer: psycopg.Connection, fetcher: psycopg.Connection, calls: int, events: int) -> None:
    """`calls` rounds: a writer's transaction of `events` events, then the consumer's fetch."""
    batch = 0
    for i in range(calls):
        with writer.transaction():
            for k in range(events):
                writer.execute(EVENT, ("U" if k % 4 else "I", DATA % (i * events + k)))
        row = fetcher.execute(FETCH, (batch,)).fetchone()
        assert row is not None
        batch = row[0]


def reset(cluster: LocalCluster) -> None:
    """Every measurement from the same state: the queue's events and old ticks gone, the tables
    the fetch reads vacuumed (else each session reads larger indexes and longer chains of row
    versions than the one before: 4 % more instructions a fetch three sessions on)."""
    with cluster.connect() as conn:
        conn.autocommit = True
        conn.execute("select pgcascade.maint_tick_cleanup('q')")
        for (part,) in conn.execute(
            "select inhrelid::regclass::text from pg_inherits where inhparent = 'pgcascade.event'::regclass"
        ).fetchall():
            conn.execute(f"truncate {part}")
        conn.execute(
            "vacuum analyze pgcascade.tick, pgcascade.subscription, pgcascade.queue, pgcascade.event"
        )


def use(cluster: LocalCluster, sql_file: Path) -> None:
    """Install the functions of `sql_file` (a 52_fetch.sql) in place of those there."""
    with cluster.connect() as conn:
        conn.autocommit = True
        conn.execute(sql_file.read_text())  # type: ignore[arg-type]


def session(cluster: LocalCluster, calls: int, events: int) -> tuple[int, float, float]:
    """A consumer's session of `calls` rounds, from the reset state: its backend's pid, the CPU
    seconds that backend spent on the rounds, and their wall-clock seconds."""
    reset(cluster)
    with cluster.connect() as writer, cluster.connect() as fetcher:
        writer.autocommit = fetcher.autocommit = True
        fetcher.execute(FETCH, (0,))  # plans made, the consumer at the newest tick
        pid = fetcher.info.backend_pid
        before, started = backend_cpu(pid), time.monotonic()
        run(writer, fetcher, calls, events)
        return pid, backend_cpu(pid) - before, time.monotonic() - started


def session_instructions(cluster: LocalCluster, out: Path, calls: int, events: int) -> int:
    """The instructions of a consumer's backend that made `calls` rounds (its callgrind file)."""
    pid, _, _ = session(cluster, calls, events)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # written as the backend exits
        time.sleep(1)
        f = out / f"cg.{pid}"
        if f.exists():
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    raise RuntimeError("no callgrind output from the consumer's backend")


def callgrind_main(cluster: LocalCluster, variants: dict[str, Path], calls: int, events: int) -> None:
    """Instructions a fetch, by variant."""
    out = cluster.basedir / "callgrind"
    server = callgrind_server(cluster, out)
    try:
        for name, sql_file in variants.items():
            use(cluster, sql_file)
            small = session_instructions(cluster, out, calls, events)
            large = session_instructions(cluster, out, 2 * calls, events)
            print(f"{name}: {(large - small) / calls:,.0f} instructions a fetch", flush=True)
    finally:
        cluster.stop()
        server.wait(timeout=120)
        shutil.rmtree(out, ignore_errors=True)  # a file per backend (the cluster's own go with it)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--events", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FILE.sql")
    ap.add_argument("--callgrind", action="store_true", help="count the backend's instructions (valgrind)")
    args = ap.parse_args()
    base = Path(schema.__file__).parent.parent / "sql" / "pgq" / "52_fetch.sql"
    variants = {"installed": base} | {k: Path(v) for k, v in (x.split("=", 1) for x in args.variant)}
    cluster = new_cluster("fetch", fast_unsafe=False, settings={"shared_buffers": "256MB"})
    try:
        with cluster.connect() as conn:
            conn.autocommit = True
            schema.install(conn)
            conn.execute("select pgcascade.create_queue('q'), pgcascade.register_consumer('q', 'c')")
        if args.callgrind:
            callgrind_main(cluster, variants, args.calls, args.events)
            return 0
        results: dict[str, list[float]] = {n: [] for n in variants}
        for rnd in range(args.rounds):
            names = list(variants)
            names = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in names:
                use(cluster, variants[name])
                _, cpu, secs = session(cluster, args.calls, args.events)
                us = 1e6 * cpu / args.calls
                results[name].append(us)
                print(
                    f"round {rnd + 1} {name}: {us:.0f} us of CPU a fetch ({args.calls / secs:.0f} rounds/s)",
                    flush=True,
                )
        print()
        for name, v in results.items():
            print(
                f"{name}: median {statistics.median(v):.0f} us a fetch ({', '.join(f'{x:.0f}' for x in v)})"
            )
    finally:
        cluster.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
