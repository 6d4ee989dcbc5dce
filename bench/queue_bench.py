#!/usr/bin/env python3
"""Queue benchmark: pgcascade's PL/pgSQL queue against PgQ 3, in one run, on one machine.

Both systems get the same workload on the same throwaway cluster (fsync and synchronous_commit
on, shared_buffers 1GB), each in a database of its own:

1. insert, one call per event: 2 connections, each `select <schema>.insert_event(q, 'type', data)`
   once per event, 1000 calls per transaction (client method: see --client);
2. insert, one statement per transaction: 2 connections, each transaction is one
   `select <schema>.insert_event(q, 'type', repeat('x', 100)) from generate_series(1, 1000)`;
3. read with one consumer: next_batch / get_batch_events / finish_batch over every event of (1),
   which were ticked every --tick-every events while they were inserted; then the streaming path
   of the Python API (`batch_event_sql` through a server-side cursor, as `Batch.events()` does),
   with a second consumer, over the same events - for both systems;
4. the size of the queue's event tables after (1), and after three rotations once the consumers
   have passed everything;
5. WAL written per event in (1) and (2);
6. CPU time of the server processes per event in (1), (2), (3): robust where wall-clock times
   are not (a 2-core machine shared with other work).

Every figure is measured --rounds times (default 3), alternating which system goes first, and
the median is reported.  Throughput ratios read pgcascade/PgQ, size, WAL and CPU ratios
PgQ/pgcascade: above 1 always means pgcascade is better.  Run `bash bench/install-peers.sh` once
(root) to install PgQ.

    .venv/bin/python bench/queue_bench.py [--quick | --events N] [--rounds R] [--client execute]
                                          [--report bench/results/queue.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from pgcascade.core import schema
from pgcascade.dev.localcluster import LocalCluster, new_cluster

PGQ_CONTROL = Path("/usr/share/postgresql/15/extension/pgq.control")
EVENTS_PER_TXN = 1000  # figure 1: calls per transaction; figure 2: events per statement
CONNECTIONS = 2
FETCH_SIZE = 5000  # rows per FETCH of the streaming path, as pgcascade.queue.Batch's default
READ_QUEUE = "bench_q"  # figures 1, 3 and 4
STMT_QUEUE = "bench_stmt_q"  # figure 2
CONSUMER = "reader"  # figure 3, get_batch_events
STREAM_CONSUMER = "stream_reader"  # figure 3, streaming path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the two systems ------------------------------------------------------------------------


class System:
    """What differs between the systems: set-up, names, sizes and rotation."""

    label = ""
    schema = ""
    dbname = ""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.connstr = ""

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.connstr, autocommit=True)

    def setup(self) -> None:
        self.connstr = self.cluster.create_database(self.dbname)
        with self.connect() as conn:
            self.install(conn)

    def install(self, conn: psycopg.Connection) -> None:
        raise NotImplementedError

    def create_queue(self, conn: psycopg.Connection, queue: str) -> None:
        conn.execute(f"select {self.schema}.create_queue(%s)", (queue,))

    def drop_queue(self, conn: psycopg.Connection, queue: str) -> None:
        conn.execute(f"select {self.schema}.drop_queue(%s, true)", (queue,))

    def register(self, conn: psycopg.Connection, queue: str, consumer: str) -> None:
        conn.execute(f"select {self.schema}.register_consumer(%s, %s)", (queue, consumer))

    def tick(self, conn: psycopg.Connection, queue: str) -> int:
        tick_id = conn.execute(f"select {self.schema}.ticker(%s)", (queue,)).fetchone()[0]
        if tick_id is None:
            raise RuntimeError(f"{self.label}: ticker({queue}) made no tick")
        return tick_id

    def insert_call_sql(self) -> str:
        return f"select {self.schema}.insert_event(%s, %s, %s)"

    def insert_stmt_sql(self) -> str:
        return (
            f"select {self.schema}.insert_event(%s, 'type', repeat('x', 100))"
            f" from generate_series(1, {EVENTS_PER_TXN})"
        )

    def next_batch(self, conn: psycopg.Connection, queue: str, consumer: str) -> int | None:
        return conn.execute(f"select {self.schema}.next_batch(%s, %s)", (queue, consumer)).fetchone()[0]

    def finish_batch(self, conn: psycopg.Connection, batch_id: int) -> None:
        conn.execute(f"select {self.schema}.finish_batch(%s)", (batch_id,))

    def get_batch_events_sql(self) -> str:
        return f"select * from {self.schema}.get_batch_events(%s)"

    def batch_event_sql(self, conn: psycopg.Connection, batch_id: int) -> str:
        return conn.execute(f"select {self.schema}.batch_event_sql(%s)", (batch_id,)).fetchone()[0]

    def event_tables(self, conn: psycopg.Connection, queue: str) -> list[str]:
        """The queue's event tables, qualified names."""
        raise NotImplementedError

    def event_tables_size(self, conn: psycopg.Connection, queue: str) -> tuple[int, int]:
        """(bytes, number of tables): pg_total_relation_size summed over the queue's event tables."""
        raise NotImplementedError

    def event_rows(self, conn: psycopg.Connection, queue: str) -> list[int]:
        """Rows in each event table of the queue, in slot order."""
        raise NotImplementedError

    def enable_rotation(self, conn: psycopg.Connection, queue: str) -> None:
        raise NotImplementedError

    def rotate(self, conn: psycopg.Connection, queue: str) -> bool:
        """One rotation attempt; True when the queue switched to its next event table."""
        raise NotImplementedError


class PgCascade(System):
    label = "pgcascade"
    schema = "pgcascade"
    dbname = "bench_pgcascade"

    def install(self, conn: psycopg.Connection) -> None:
        schema.install(conn)

    def event_tables(self, conn: psycopg.Connection, queue: str) -> list[str]:
        rows = conn.execute(
            "select c.oid::regclass::text from pg_inherits i join pg_class c on c.oid = i.inhrelid"
            " where i.inhparent = 'pgcascade.event'::regclass"
            "   and c.relname like format('event\\_%%s\\_%%%%', (select queue_id from pgcascade.queue"
            "                                                   where queue_name = %s))"
            " order by c.relname",
            (queue,),
        ).fetchall()
        return [r[0] for r in rows]

    def event_tables_size(self, conn: psycopg.Connection, queue: str) -> tuple[int, int]:
        parts = self.event_tables(conn, queue)
        # the partitioned parent has no storage of its own (0 bytes); counted for symmetry
        size = conn.execute(
            "select pg_total_relation_size('pgcascade.event')"
            " + coalesce((select sum(pg_total_relation_size(p::regclass)) from unnest(%s::text[]) p), 0)",
            (parts,),
        ).fetchone()[0]
        return int(size), len(parts)

    def event_rows(self, conn: psycopg.Connection, queue: str) -> list[int]:
        return [
            conn.execute(f"select count(*) from {p}").fetchone()[0] for p in self.event_tables(conn, queue)
        ]

    def enable_rotation(self, conn: psycopg.Connection, queue: str) -> None:
        conn.execute("select pgcascade.set_queue_config(%s, 'rotation_period', '0')", (queue,))

    def rotate(self, conn: psycopg.Connection, queue: str) -> bool:
        return conn.execute("select pgcascade.maint_rotate_tables(%s)", (queue,)).fetchone()[0] == 1


class PgQ(System):
    label = "PgQ"
    schema = "pgq"
    dbname = "bench_pgq"

    def install(self, conn: psycopg.Connection) -> None:
        conn.execute("create extension pgq")

    def create_queue(self, conn: psycopg.Connection, queue: str) -> None:
        super().create_queue(conn, queue)
        # pgq.ticker(queue) declines to tick below these thresholds; tick whenever asked, as
        # pgcascade.ticker(queue) does
        conn.execute("select pgq.set_queue_config(%s, 'ticker_max_lag', '0')", (queue,))
        conn.execute("select pgq.set_queue_config(%s, 'ticker_idle_period', '0')", (queue,))

    def event_tables(self, conn: psycopg.Connection, queue: str) -> list[str]:
        rows = conn.execute(
            "select c.oid::regclass::text from pgq.queue q, pg_class c"
            " where q.queue_name = %s and (c.oid = q.queue_data_pfx::regclass"
            "   or c.oid in (select inhrelid from pg_inherits where inhparent = q.queue_data_pfx::regclass))"
            " order by c.relname",
            (queue,),
        ).fetchall()
        return [r[0] for r in rows]

    def event_tables_size(self, conn: psycopg.Connection, queue: str) -> tuple[int, int]:
        tables = self.event_tables(conn, queue)
        size = conn.execute(
            "select coalesce(sum(pg_total_relation_size(t::regclass)), 0) from unnest(%s::text[]) t",
            (tables,),
        ).fetchone()[0]
        return int(size), len(tables)

    def event_rows(self, conn: psycopg.Connection, queue: str) -> list[int]:
        # the children only (the parent pgq.event_N holds no rows of its own)
        return [
            conn.execute(f"select count(*) from only {t}").fetchone()[0]
            for t in self.event_tables(conn, queue)[1:]
        ]

    def enable_rotation(self, conn: psycopg.Connection, queue: str) -> None:
        conn.execute("select pgq.set_queue_config(%s, 'rotation_period', '0')", (queue,))

    def rotate(self, conn: psycopg.Connection, queue: str) -> bool:
        def cur_table() -> int:
            return conn.execute(
                "select queue_cur_table from pgq.queue where queue_name = %s", (queue,)
            ).fetchone()[0]

        before = cur_table()
        conn.execute("select pgq.maint_rotate_tables_step1(%s)", (queue,))  # own transaction
        conn.execute("select pgq.maint_rotate_tables_step2()")  # own transaction
        return cur_table() != before


# --- workloads ------------------------------------------------------------------------------


@dataclass
class Progress:
    """Events committed so far by the inserters; the ticker thread follows it."""

    committed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.committed += n


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def backend_cpu(conn: psycopg.Connection) -> float:
    """CPU seconds (user + system) that the server process of `conn` has used so far.

    Wall-clock figures on a small shared machine are noisy; the server's CPU per event is not.
    The cluster is local, so its processes' /proc entries are readable (0.0 if they are not)."""
    try:
        stat = Path(f"/proc/{conn.info.backend_pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(stat[11]) + int(stat[12])) / _CLK_TCK


def run_parallel(workers: list[Callable[[], Callable[[], None]]]) -> float:
    """Run the workers in threads, started together; wall time of the slowest, in seconds.

    Each worker is called first to set up (connect), untimed, and returns the timed body."""
    barrier = threading.Barrier(len(workers) + 1)
    errors: list[BaseException] = []

    def wrap(setup: Callable[[], Callable[[], None]]) -> None:
        try:
            body = setup()
            barrier.wait()
            body()
        except BaseException as e:
            errors.append(e)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()

    threads = [threading.Thread(target=wrap, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


def insert_one_call_per_event(
    system: System, queue: str, n_events: int, client: str, tick_every: int
) -> tuple[float, int, float]:
    """Figure 1: (seconds, ticks made, server CPU seconds of the inserters)."""
    sql = system.insert_call_sql()
    per_conn = n_events // CONNECTIONS
    progress = Progress()
    done = threading.Event()
    ticks = 0
    cpu: list[float] = []

    def inserter(conn_no: int):
        conn = system.connect()

        def body() -> None:
            cpu0 = backend_cpu(conn)
            try:
                cur = conn.cursor()
                sent = 0
                while sent < per_conn:
                    n = min(EVENTS_PER_TXN, per_conn - sent)
                    params = [(queue, "type", f"{conn_no}:{sent + i:012d}".ljust(100, "x")) for i in range(n)]
                    with conn.transaction():
                        if client == "pipeline":
                            # psycopg 3 sends the n statements in pipeline mode, results discarded
                            cur.executemany(sql, params)
                        else:
                            for p in params:
                                cur.execute(sql, p)
                    sent += n
                    progress.add(n)
                cpu.append(backend_cpu(conn) - cpu0)
            finally:
                conn.close()

        return body

    def ticker(conn: psycopg.Connection) -> None:
        nonlocal ticks
        next_at = tick_every
        while True:
            finished = done.is_set()
            if progress.committed >= next_at or finished:
                system.tick(conn, queue)  # after the inserters: the last tick, closing the last batch
                ticks += 1
                next_at += tick_every
                if finished:
                    return
            else:
                time.sleep(0.001)

    # the ticker is not timed: it runs beside the timed inserters
    errors: list[BaseException] = []
    with system.connect() as tick_conn:

        def tick_thread_main() -> None:
            try:
                ticker(tick_conn)
            except BaseException as e:
                errors.append(e)

        tick_thread = threading.Thread(target=tick_thread_main)
        tick_thread.start()
        try:
            elapsed = run_parallel([lambda k=k: inserter(k) for k in range(CONNECTIONS)])
        finally:
            done.set()
            tick_thread.join()
    if errors:
        raise errors[0]
    return elapsed, ticks, sum(cpu)


def insert_one_statement_per_txn(system: System, queue: str, n_events: int) -> tuple[float, float]:
    """Figure 2: (seconds, server CPU seconds of the inserters)."""
    sql = system.insert_stmt_sql()
    per_conn = n_events // CONNECTIONS // EVENTS_PER_TXN
    cpu: list[float] = []

    def inserter():
        conn = system.connect()

        def body() -> None:
            cpu0 = backend_cpu(conn)
            try:
                cur = conn.cursor()
                for _ in range(per_conn):
                    cur.execute(sql, (queue,))  # autocommit: one statement, one transaction
                cpu.append(backend_cpu(conn) - cpu0)
            finally:
                conn.close()

        return body

    return run_parallel([inserter for _ in range(CONNECTIONS)]), sum(cpu)


def read_get_batch_events(system: System, queue: str, consumer: str) -> tuple[float, int, int, float]:
    """Figure 3: next_batch / get_batch_events / finish_batch until no batch;
    (seconds, events, batches, server CPU seconds)."""
    with system.connect() as conn:
        sql = system.get_batch_events_sql()
        events = batches = 0
        cpu0 = backend_cpu(conn)
        start = time.perf_counter()
        while True:
            batch_id = system.next_batch(conn, queue, consumer)
            if batch_id is None:
                break
            with conn.cursor() as cur:
                cur.execute(sql, (batch_id,))
                for _row in cur:
                    events += 1
            system.finish_batch(conn, batch_id)
            batches += 1
        return time.perf_counter() - start, events, batches, backend_cpu(conn) - cpu0


def read_streaming(system: System, queue: str, consumer: str) -> tuple[float, int, int, float]:
    """Figure 3, streaming path: batch_event_sql through a server-side cursor, as pgcascade's
    Batch.events() (tuple rows here, for both systems); finish_batch in the same transaction,
    as pgcascade's Consumer.run_once()."""
    with system.connect() as conn:
        events = batches = 0
        cpu0 = backend_cpu(conn)
        start = time.perf_counter()
        while True:
            batch_id = system.next_batch(conn, queue, consumer)
            if batch_id is None:
                break
            with conn.transaction():
                sql = system.batch_event_sql(conn, batch_id)
                with conn.cursor(name=f"bench_batch_{batch_id}") as cur:
                    cur.itersize = FETCH_SIZE
                    cur.execute(sql)
                    for _row in cur:
                        events += 1
                system.finish_batch(conn, batch_id)
            batches += 1
        return time.perf_counter() - start, events, batches, backend_cpu(conn) - cpu0


def catch_up(system: System, conn: psycopg.Connection, queue: str, consumers: list[str]) -> None:
    """Tick, then move every consumer past every tick (the batches hold no events any more)."""
    system.tick(conn, queue)
    for c in consumers:
        while (batch_id := system.next_batch(conn, queue, c)) is not None:
            system.finish_batch(conn, batch_id)


def rotate_out(system: System, queue: str, consumers: list[str], wanted: int = 3, max_attempts: int = 20):
    """Rotate `wanted` times (ticking and letting the consumers catch up between attempts).
    Returns (rotations done, attempts, size, tables, rows per table)."""
    with system.connect() as conn:
        system.enable_rotation(conn, queue)
        done = attempts = 0
        while done < wanted and attempts < max_attempts:
            attempts += 1
            if system.rotate(conn, queue):
                done += 1
            catch_up(system, conn, queue, consumers)
        size, tables = system.event_tables_size(conn, queue)
        return done, attempts, size, tables, system.event_rows(conn, queue)


def checkpoint(system: System) -> None:
    """Start every timed phase from a clean checkpoint, so no system pays for the other's writes."""
    with system.connect() as conn:
        conn.execute("checkpoint")


def wal_lsn(system: System) -> int:
    with system.connect() as conn:
        return int(conn.execute("select pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])


def autovacuum_runs(system: System, queue: str) -> tuple[int, int]:
    """(autovacuum runs, autoanalyze runs) on the queue's event tables so far."""
    with system.connect() as conn:
        conn.execute("select pg_stat_clear_snapshot()")
        tables = system.event_tables(conn, queue)
        row = conn.execute(
            "select coalesce(sum(autovacuum_count), 0), coalesce(sum(autoanalyze_count), 0)"
            " from pg_stat_all_tables where relid = any(%s::regclass[])",
            (tables,),
        ).fetchone()
        return int(row[0]), int(row[1])


# --- one round ------------------------------------------------------------------------------


def run_round(rnd: int, systems: list[System], n_events: int, args: argparse.Namespace) -> dict[str, dict]:
    """Every figure once for every system, in the order given; the round's queues are dropped after."""
    res: dict[str, dict] = {s.label: {} for s in systems}
    read_q, stmt_q = f"{READ_QUEUE}_{rnd}", f"{STMT_QUEUE}_{rnd}"
    for s in systems:
        with s.connect() as conn:
            s.create_queue(conn, read_q)
            # a consumer sees only events inserted after it registered: register first
            s.register(conn, read_q, CONSUMER)
            s.register(conn, read_q, STREAM_CONSUMER)
            s.create_queue(conn, stmt_q)

    for s in systems:
        checkpoint(s)
        lsn = wal_lsn(s)
        secs, cpu = insert_one_statement_per_txn(s, stmt_q, n_events)
        res[s.label]["stmt"] = n_events / secs
        res[s.label]["stmt_cpu"] = cpu / n_events * 1e6
        res[s.label]["stmt_wal"] = (wal_lsn(s) - lsn) / n_events
        res[s.label]["av"] = autovacuum_runs(s, stmt_q)
        with s.connect() as conn:
            s.drop_queue(conn, stmt_q)
        log(
            f"round {rnd} {s.label}: insert, one statement per txn: {n_events / secs:,.0f} events/s ({secs:.1f} s)"
        )

    for s in systems:
        checkpoint(s)
        lsn = wal_lsn(s)
        secs, ticks, cpu = insert_one_call_per_event(s, read_q, n_events, args.client, args.tick_every)
        res[s.label]["call"] = n_events / secs
        res[s.label]["call_cpu"] = cpu / n_events * 1e6
        res[s.label]["call_wal"] = (wal_lsn(s) - lsn) / n_events
        with s.connect() as conn:
            size, tables = s.event_tables_size(conn, read_q)
            rows = s.event_rows(conn, read_q)
        if sum(rows) != n_events:
            raise RuntimeError(f"{s.label}: {sum(rows):,} events in the event tables, expected {n_events:,}")
        res[s.label]["size"] = size
        res[s.label]["ticks"] = ticks
        log(
            f"round {rnd} {s.label}: insert, one call per event ({args.client}): {n_events / secs:,.0f} events/s"
            f" ({secs:.1f} s), {ticks} ticks; {tables} event tables: {fmt_size(size)}, rows {rows}"
        )

    for s in systems:
        checkpoint(s)
        secs, events, batches, cpu = read_get_batch_events(s, read_q, CONSUMER)
        if events != n_events:
            raise RuntimeError(f"{s.label}: the consumer read {events:,} events, expected {n_events:,}")
        res[s.label]["read"] = events / secs
        res[s.label]["read_cpu"] = cpu / n_events * 1e6
        res[s.label]["batches"] = batches
        log(
            f"round {rnd} {s.label}: read, get_batch_events: {events / secs:,.0f} events/s ({batches} batches)"
        )

    for s in systems:
        checkpoint(s)
        secs, events, batches, cpu = read_streaming(s, read_q, STREAM_CONSUMER)
        if events != n_events:
            raise RuntimeError(
                f"{s.label}: the streaming consumer read {events:,} events, expected {n_events:,}"
            )
        res[s.label]["stream"] = events / secs
        res[s.label]["stream_cpu"] = cpu / n_events * 1e6
        log(f"round {rnd} {s.label}: read, streaming: {events / secs:,.0f} events/s ({batches} batches)")

    for s in systems:
        done, attempts, size, tables, rows = rotate_out(s, read_q, [CONSUMER, STREAM_CONSUMER])
        res[s.label]["rotated_size"] = size
        res[s.label]["rotation"] = (done, attempts, tables, rows)
        av = autovacuum_runs(s, read_q)
        prev = res[s.label]["av"]
        res[s.label]["av"] = (prev[0] + av[0], prev[1] + av[1])
        with s.connect() as conn:
            s.drop_queue(conn, read_q)
        log(
            f"round {rnd} {s.label}: {done} rotations in {attempts} attempts; afterwards {tables} event tables,"
            f" {fmt_size(size)}, rows {rows}"
        )
    return res


# --- reporting ------------------------------------------------------------------------------


@dataclass
class Row:
    figure: str
    key: str
    unit: str
    higher_is_better: bool = True
    fmt: str = "{:,.0f}"
    per_event: bool = False  # divide by the number of events

    def values(self, rounds: list[dict[str, dict]], label: str, n_events: int) -> list[float]:
        return [r[label][self.key] / (n_events if self.per_event else 1) for r in rounds]

    def show(self, v: float) -> str:
        return fmt_size(v) if self.fmt == "size" else self.fmt.format(v)


def fmt_size(n: float) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):,.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):,.1f} KiB"
    return f"{n:,.0f} B"


ROWS = [
    Row("1. insert, one call per event (2 conns, 1000 calls/txn)", "call", "events/s"),
    Row("2. insert, one statement per txn (2 conns, 1000 events/stmt)", "stmt", "events/s"),
    Row("3a. read: next_batch / get_batch_events / finish_batch", "read", "events/s"),
    Row("3b. read: batch_event_sql through a server-side cursor", "stream", "events/s"),
    Row("4a. event tables after the events of figure 1", "size", "bytes", False, "size"),
    Row("4b. event tables per event", "size", "bytes/event", False, "{:,.1f}", per_event=True),
    Row("4c. event tables after 3 rotations", "rotated_size", "bytes", False, "size"),
    Row("5a. WAL written per event, figure 1", "call_wal", "bytes/event", False, "{:,.1f}"),
    Row("5b. WAL written per event, figure 2", "stmt_wal", "bytes/event", False, "{:,.1f}"),
    Row("6a. server CPU per event, figure 1", "call_cpu", "µs/event", False, "{:,.2f}"),
    Row("6b. server CPU per event, figure 2", "stmt_cpu", "µs/event", False, "{:,.2f}"),
    Row("6c. server CPU per event, figure 3a", "read_cpu", "µs/event", False, "{:,.2f}"),
    Row("6d. server CPU per event, figure 3b", "stream_cpu", "µs/event", False, "{:,.2f}"),
]


def report_tables(rounds: list[dict[str, dict]], n_events: int) -> list[str]:
    med = statistics.median
    out = [
        "| figure | unit | pgcascade | PgQ | ratio | ratio reads |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for row in ROWS:
        ours, peer = med(row.values(rounds, "pgcascade", n_events)), med(row.values(rounds, "PgQ", n_events))
        if row.higher_is_better:
            ratio, reads = (ours / peer if peer else float("inf")), "pgcascade/PgQ (>1: pgcascade faster)"
        else:
            ratio, reads = (peer / ours if ours else float("inf")), "PgQ/pgcascade (>1: pgcascade less)"
        out.append(
            f"| {row.figure} | {row.unit} | {row.show(ours)} | {row.show(peer)} | {ratio:.2f} | {reads} |"
        )
    if len(rounds) > 1:
        out += [
            "",
            f"Each round ({len(rounds)} rounds, the median above):",
            "",
            "| figure | "
            + " | ".join(f"round {i + 1} pgcascade / PgQ (ratio)" for i in range(len(rounds)))
            + " |",
            "| --- |" + " ---: |" * len(rounds),
        ]
        for row in ROWS[:4]:
            cells = []
            for r in rounds:
                o, p = r["pgcascade"][row.key], r["PgQ"][row.key]
                cells.append(f"{row.show(o)} / {row.show(p)} ({o / p:.2f})")
            out.append(f"| {row.figure} | " + " | ".join(cells) + " |")
    return out


def machine_info(conn: psycopg.Connection) -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1])
        mem = f"{kb / (1 << 20):.0f} GiB"
    pg = conn.execute("show server_version").fetchone()[0]
    pgq = conn.execute("select extversion from pg_extension where extname = 'pgq'").fetchone()
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem} RAM, {platform.system()} {platform.release()};"
        f" PostgreSQL {pg}; PgQ {pgq[0] if pgq else '?'}; psycopg {psycopg.__version__}"
        f" (libpq {psycopg.pq.version() // 10000}); Python {platform.python_version()}"
    )


def source_info() -> str:
    """The pgcascade source measured: git commit, and the SQL files changed since, if any."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        return r.stdout if r.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD").strip()
    if not commit:
        return "pgcascade (not a git checkout)"
    changed = [line[3:] for line in git("status", "--porcelain", "src/pgcascade/sql").splitlines()]
    return f"pgcascade at commit {commit}" + (
        f", with uncommitted changes in {', '.join(changed)}" if changed else ", SQL unchanged since"
    )


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000, help="events per figure (default 1,000,000)")
    ap.add_argument("--quick", action="store_true", help="100,000 events: a smoke test")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="repeat every figure this many times, alternating which system goes first; report the"
        " median (default 3)",
    )
    ap.add_argument(
        "--tick-every", type=int, default=20_000, help="tick every N committed events (default 20,000)"
    )
    ap.add_argument(
        "--client",
        choices=["pipeline", "execute"],
        default="pipeline",
        help="figure 1 client method, the same for both systems: psycopg 3 pipeline mode (executemany)"
        " or one blocking execute() per call (default pipeline)",
    )
    ap.add_argument("--report", type=Path, help="also write the results as Markdown to this file")
    args = ap.parse_args(argv)
    n_events = 100_000 if args.quick else args.events
    if n_events % (CONNECTIONS * EVENTS_PER_TXN):
        ap.error(f"--events must be a multiple of {CONNECTIONS * EVENTS_PER_TXN}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not PGQ_CONTROL.exists():
        print("PgQ is not installed: run `bash bench/install-peers.sh` (as root) first", file=sys.stderr)
        return 2

    load_start = os.getloadavg()
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd() + "/") else "python"
    command = " ".join(shlex.quote(a) for a in [python, sys.argv[0], *(argv or sys.argv[1:])])
    started = datetime.datetime.now().astimezone()
    source = source_info()
    log(f"starting a cluster (fsync and synchronous_commit on, shared_buffers 1GB); {n_events:,} events")
    cluster = new_cluster("bench", fast_unsafe=False, settings={"shared_buffers": "1GB"})
    try:
        systems: list[System] = [PgCascade(cluster), PgQ(cluster)]
        for s in systems:
            s.setup()
        with systems[1].connect() as conn:
            machine = machine_info(conn)
        rounds = []
        for rnd in range(args.rounds):
            order = systems if rnd % 2 == 0 else systems[::-1]
            log(f"round {rnd + 1} of {args.rounds}: {' first, then '.join(s.label for s in order)}")
            rounds.append(run_round(rnd + 1, order, n_events, args))
        load = os.getloadavg()
        elapsed = datetime.datetime.now().astimezone() - started
    finally:
        cluster.destroy()
        shutil.rmtree(cluster.basedir, ignore_errors=True)

    last = rounds[-1]
    client_desc = (
        "psycopg 3 pipeline mode (`cursor.executemany`, 1000 statements per transaction, results discarded)"
        if args.client == "pipeline"
        else "psycopg 3, one blocking `cursor.execute` per call (a round trip each)"
    )

    def sys_notes(label: str) -> str:
        ticks = [r[label]["ticks"] for r in rounds]
        batches = [r[label]["batches"] for r in rounds]
        done, attempts, tables, rows = last[label]["rotation"]
        av = [r[label]["av"] for r in rounds]
        return (
            f"{label}: ticks per round {ticks}, batches per round {batches}; rotation (last round):"
            f" {done} rotations in {attempts} attempts, then {tables} event tables with rows {rows};"
            f" autovacuum / autoanalyze runs on the event tables per round {av}"
        )

    lines = [
        f"# Queue benchmark: pgcascade vs PgQ ({started:%Y-%m-%d %H:%M %Z})",
        "",
        f"- machine: {machine}; load average (1, 5, 15 min) at the start"
        f" {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at the end {load[0]:.2f} {load[1]:.2f}"
        f" {load[2]:.2f}",
        f"- source: {source}",
        f"- command: `{command}` ({elapsed.total_seconds() / 60:.1f} minutes)",
        "- cluster: one throwaway cluster, fsync and synchronous_commit on, shared_buffers 1GB;"
        " one database per system; CHECKPOINT before each timed phase",
        f"- events: {n_events:,} per figure, 100 characters of data each, type 'type';"
        f" {args.rounds} rounds, alternating which system goes first; medians",
        f"- figure 1 client method (both systems): {client_desc}",
        f"- ticks: every {args.tick_every:,} committed events during figure 1 (a ticker thread beside the"
        " inserters, untimed); figure 2 has no ticks and no consumer",
        f"- figure 3b: `batch_event_sql(batch_id)` through a named (server-side) cursor, {FETCH_SIZE} rows"
        " per fetch, tuple rows, finish_batch in the same transaction (pgcascade's Batch.events() /"
        " Consumer.run_once() path), a second consumer over the same events",
        "- figure 4: pg_total_relation_size summed over the queue's event tables (heap, indexes, TOAST,"
        " free-space and visibility maps): pgcascade's partitions of pgcascade.event, PgQ's pgq.event_N"
        " and its children; rotation: rotation_period 0, then rotate (PgQ: step1 and step2, each in its"
        " own transaction), tick and let both consumers catch up, three times",
        "- figure 5: pg_current_wal_lsn() before and after the insert phase, per event",
        "- figure 6: CPU time (user + system, /proc/PID/stat) of the server processes serving the"
        " timed connections (inserters, consumer), per event: the cost in the server, without the"
        " noise of a shared machine; WAL writer, checkpointer and client are not counted",
        "",
        "Ratios: throughput pgcascade/PgQ; size, WAL and CPU PgQ/pgcascade: above 1 means pgcascade is"
        " better.",
        "",
        *report_tables(rounds, n_events),
        "",
        f"- {sys_notes('pgcascade')}",
        f"- {sys_notes('PgQ')}",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
        log(f"wrote {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
