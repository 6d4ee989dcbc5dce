#!/usr/bin/env python3
"""Replication benchmark: pgcascade against Londiste 3 and native logical replication, in one run.

Every system gets the same workloads on the same two fresh clusters (provider and subscriber, on
loopback; wal_level=logical, shared_buffers=1GB, fsync and synchronous_commit on), as
../shared/anchors/README.md describes them.  Each system works in databases of its own, made
from one template (`CREATE DATABASE ... TEMPLATE ... STRATEGY FILE_COPY`), so every run starts
from the same data.  The pgbench schema is at scale 10 (W3: scale 50) with `pgbench_history`
given `hid bigserial primary key`; pgbench always runs with -n.

W1   pgbench TPC-B TPS on the provider, `-c2 -j2 -T30`: no replication, then with each system
     replicating the four pgbench tables (pgcascade: capture, ticker, leaf worker; Londiste 3:
     its triggers, pgqd, leaf worker; native: a publication and a subscription).  --rounds runs,
     the order rotating; the median is reported, and the ratio to no replication.
W2a  catch-up: with the consumer stopped (pgcascade: ticker on, worker paused; Londiste: worker
     off; native: subscription disabled) `pgbench -N -c2 -t N/2` makes N transactions (2N row
     changes); then the consumer starts (pgcascade: resumed; native: enabled) and the
     subscriber is polled every 50 ms until history count, max(hid), teller and branch sums,
     then the accounts' sum, equal the provider's.
     rows/s = 2N / seconds, the clock including the consumer's start-up.  N = 1,000,000
     (--backlogs, which may list several; 20,000 only with --quick).
W2b  lag at a steady 500 and 2,000 tps (`pgbench -N -R RATE -c2 -j2 -T30`; --lag-rates): a
     heartbeat row (table `heartbeat(id int primary key, t timestamptz)`, replicated too) is
     updated every 50 ms on the
     provider and polled every 10 ms on the subscriber; each update's lag is the time from its
     commit until the subscriber shows it (or a later one).  Median, p95, max.
W3   initial copy of pgbench_accounts at scale 50 and 200 (5,000,000 rows, 640 MB, and
     20,000,000 rows, 2.6 GB; --w3-scales) into an empty subscriber table with the same definition, with the
     daemons running and no writes:
     pgcascade from leaf add-table until the state is ok; Londiste from leaf add-table until its
     state is ok (ticker_idle_period lowered to 1 s); native from CREATE SUBSCRIPTION until
     every table is 'r'.  Reference: `psql -c "\\copy ... to stdout" | psql -c "\\copy ... from
     stdin"` into an unindexed table, then ALTER TABLE ADD PRIMARY KEY.

W4   one transaction updating every row of pgbench_accounts at scale 50 (5,000,000 rows) on the
     provider, with the consumers running and the subscriber holding the same rows: the time
     until the subscriber shows it (one row's new value, polled every 50 ms: each system applies
     the transaction atomically; every row is compared after), after the commit and in all, and
     the pgcascade worker's peak resident set (VmHWM).  Londiste is not measured (5,000,000 single-row statements).

pgcascade runs with its shipped defaults, the same configuration for every figure; its logical
capture (W1, W2b) and two diagnostics of W1 (its capture alone, with no ticker and no worker)
are reported beside it.  With its defaults the script runs every figure of issue 25 in one go
(~80 minutes) and prints each goal as met or not.

    bash bench/install-peers.sh                       # once, as root: Londiste 3 and pgqd
    .venv/bin/python bench/replication_bench.py [--quick] [--only W1,W2a,W2b,W3,W4] [--rounds R]
                                                [--backlogs 1000000,100000,20000,10000]
                                                [--lag-rates 500,2000] [--w3-scales 50,200]
                                                [--report bench/results/replication.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from pgcascade.cascade import admin
from pgcascade.dev.localcluster import LocalCluster, new_cluster, pg_bindir

ROOT = Path(__file__).resolve().parent.parent
BIN = pg_bindir()
PGBENCH = str(BIN / "pgbench")
PSQL = str(BIN / "psql")
LONDISTE = ["/usr/bin/python3", "/usr/bin/londiste"]  # the system Python has psycopg2
PGQD = "/usr/bin/pgqd"
PGCASCADE = [sys.executable, "-m", "pgcascade"]
PGBENCH_TABLES = ["pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history"]
TABLES = [*PGBENCH_TABLES, "heartbeat"]
QUEUE = "bench"
W3_TABLE = "pgbench_accounts"
ALL_WORKLOADS = ("W1", "W2a", "W2b", "W3", "W4")
W4_UPDATE = f"update {W3_TABLE} set abalance = abalance + 1"  # 5,000,000 rows, one transaction
W4_PROBE = f"select abalance from {W3_TABLE} where aid = 1"
NA = "-"  # no figure
COPY_IN = f"\\copy {W3_TABLE} from stdin"

# --- pgcascade settings (documented in the report) ------------------------------------------
# None: pgcascade runs with its shipped defaults, one configuration for every figure (issue 25).
# A figure that needs other settings may be reported beside the default one, never instead.
PGC_LEAF: dict[str, str] = {}  # the leaf's ini keys
PGC_TICKER: dict[str, str] = {}  # the ticker's ini keys
PGC_QUEUE: dict[str, str] = {}  # set_queue_config(queue, key, value)
# --- peers' settings ----------------------------------------------------------------------
LONDISTE_LOOP_DELAY = "0.1"
PGQD_TICKER_PERIOD = "1"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


# --- processes: every one we start is tracked and stopped by its pid ---------------------------


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], logfile: Path) -> subprocess.Popen:
        out = logfile.open("ab")
        # SIGINT as by default even when this bench runs as a shell's background job (which
        # ignores it): a daemon stopped right after its start would ignore the signal
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        out.close()
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen | None, sig: int = signal.SIGINT, timeout: float = 30) -> None:
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"pid {p.pid} did not stop after {sig}: SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        if p in self.procs:
            self.procs.remove(p)

    def close(self) -> None:
        for p in list(self.procs):
            self.stop(p, signal.SIGTERM, timeout=10)


PROCS = Procs()


# --- the clusters and their databases ----------------------------------------------------------


@dataclass
class Env:
    prov: LocalCluster
    sub: LocalCluster
    work: Path  # configs and logs

    def base_connstr(self, c: LocalCluster) -> str:
        return f"host=127.0.0.1 port={c.port} user=postgres"


@dataclass
class Pair:
    """The provider and subscriber databases of one system in one workload."""

    env: Env
    name: str

    @property
    def prov(self) -> str:
        return self.env.prov.connstr(self.name)

    @property
    def sub(self) -> str:
        return self.env.sub.connstr(self.name)

    def pconn(self) -> psycopg.Connection:
        return psycopg.connect(self.prov, autocommit=True)

    def sconn(self) -> psycopg.Connection:
        return psycopg.connect(self.sub, autocommit=True)

    def drop(self) -> None:
        for c in (self.env.prov, self.env.sub):
            with contextlib.suppress(psycopg.Error):
                c.drop_database(self.name)


def clone(c: LocalCluster, template: str, name: str) -> None:
    with c.connect() as conn:
        conn.execute(f'drop database if exists "{name}" with (force)')
        conn.execute(f'create database "{name}" template "{template}" strategy file_copy')


def checkpoint(*clusters: LocalCluster) -> None:
    for c in clusters:
        with c.connect() as conn:
            conn.execute("checkpoint")


def pgbench_args(c: LocalCluster, dbname: str) -> list[str]:
    return ["-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres", dbname]


def make_template(c: LocalCluster, name: str, scale: int) -> None:
    """pgbench schema at `scale`, history with a bigserial primary key, the heartbeat table."""
    c.create_database(name)
    run([PGBENCH, "-i", "-q", "-s", str(scale), *pgbench_args(c, name)], timeout=1800)
    with c.connect(name) as conn:
        conn.execute("alter table pgbench_history add column hid bigserial primary key")
        conn.execute("create table heartbeat (id int primary key, t timestamptz)")
        conn.execute("insert into heartbeat values (1, now())")
        conn.execute("vacuum analyze")
    checkpoint(c)


def make_w3_subscriber_template(c: LocalCluster, name: str) -> None:
    """An empty pgbench_accounts with the provider's definition (pgbench -i -I dtp: tables, keys)."""
    c.create_database(name)
    run([PGBENCH, "-i", "-q", "-I", "dtp", "-s", "50", *pgbench_args(c, name)], timeout=600)
    with c.connect(name) as conn:
        conn.execute("drop table pgbench_branches, pgbench_tellers, pgbench_history")


def pgbench_run(c: LocalCluster, dbname: str, *args: str, timeout: float = 1800) -> float:
    """pgbench -n ARGS on the database; returns its tps."""
    r = run([PGBENCH, "-n", *args, *pgbench_args(c, dbname)], timeout=timeout)
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", r.stdout)
    if not m:
        raise RuntimeError(f"pgbench: no tps in its output:\n{r.stdout}\n{r.stderr}")
    return float(m.group(1))


# --- the systems ---------------------------------------------------------------------------------


class System:
    label = ""
    key = ""
    workloads: frozenset[str] | None = None  # those it runs after W1, when not all

    def __init__(self, env: Env):
        self.env = env

    def setup(self, pair: Pair, tables: list[str], copy: bool = False) -> None:
        """Replicate `tables` from pair.prov to pair.sub and start the daemons.  copy=False: the
        subscriber has the same rows already (no initial copy)."""

    def stop_consumer(self, pair: Pair) -> None:
        pass

    def start_consumer(self, pair: Pair) -> None:
        pass

    def add_table_timed(self, pair: Pair, table: str) -> None:
        """W3: the timed action that starts the initial copy of `table`."""
        raise NotImplementedError

    def in_sync(self, pair: Pair, table: str) -> bool:
        """W3: whether `table` is in sync (the system's own view)."""
        raise NotImplementedError

    def teardown(self, pair: Pair) -> None:
        pass

    def notes(self) -> str:
        return ""


class NoReplication(System):
    label = "no replication"
    key = "none"


class CaptureOnly(System):
    """W1 diagnostic: pgcascade's capture triggers on the provider, no ticker and no worker."""

    label = "pgcascade, capture only"
    key = "pgcascade-capture"

    def __init__(self, env: Env):
        super().__init__(env)
        self.pgc = PgCascade(env)

    def setup(self, pair: Pair, tables: list[str], copy: bool = False) -> None:
        self.pgc.setup(pair, tables, copy)
        self.pgc.teardown(pair)  # stops the worker and the ticker; the capture stays


class PgCascade(System):
    label = "pgcascade"
    key = "pgcascade"
    ticker_settings = PGC_TICKER
    queue_settings = PGC_QUEUE

    def __init__(self, env: Env):
        super().__init__(env)
        self.ticker: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.dir = env.work / "pgcascade"

    def ini(self, name: str, **keys: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{name}.ini"
        lines = [
            "[pgcascade]",
            f"job_name = {name}",
            *(f"{k} = {v}" for k, v in keys.items()),
            f"logfile = {self.dir}/{name}.log",
            f"pidfile = {self.dir}/{name}.pid",
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    def cli(self, ini: Path, *args: str) -> str:
        return run([*PGCASCADE, str(ini), *args], timeout=300).stdout

    def setup(self, pair: Pair, tables: list[str], copy: bool = False) -> None:
        self.root_ini = self.ini("root", db=pair.prov, queue_name=QUEUE)
        self.leaf_ini = self.ini("leaf", db=pair.sub, queue_name=QUEUE, **PGC_LEAF)
        self.ticker_ini = self.ini("ticker", db=pair.prov, **self.ticker_settings)
        self.create_root()
        self.cli(self.leaf_ini, "create-leaf", "leaf", f"--provider={pair.prov}")
        with pair.pconn() as conn:
            for k, v in self.queue_settings.items():
                conn.execute("select pgcascade.set_queue_config(%s, %s, %s)", (QUEUE, k, v))
        self.cli(self.root_ini, "add-table", *tables)
        if not copy:
            self.cli(self.leaf_ini, "add-table", *tables, "--expect-sync")
        self.ticker = PROCS.start([*PGCASCADE, "ticker", str(self.ticker_ini)], self.dir / "ticker.out")
        self.start_consumer(pair)

    def create_root(self) -> None:
        self.cli(self.root_ini, "create-root", "root")

    def start_consumer(self, pair: Pair) -> None:
        """The worker's first start, or `resume` of the running, paused one (as native's
        ENABLE of a disabled subscription: no process start in the timed part)."""
        if self.worker is None:
            self.worker = PROCS.start([*PGCASCADE, str(self.leaf_ini), "worker"], self.dir / "worker.out")
            return
        with pair.sconn() as conn:
            admin.set_paused(conn, QUEUE, "leaf", False)

    def stop_consumer(self, pair: Pair) -> None:
        """`pause` (as native's DISABLE), then a second for the worker's round in flight to end."""
        with pair.sconn() as conn:
            admin.set_paused(conn, QUEUE, "leaf", True)
        time.sleep(1.5)

    def add_table_timed(self, pair: Pair, table: str) -> None:
        self.cli(self.leaf_ini, "add-table", table)

    def in_sync(self, pair: Pair, table: str) -> bool:
        with pair.sconn() as conn:
            row = conn.execute(
                "select state from pgcascade.subscriber_table where table_name = %s", (f"public.{table}",)
            ).fetchone()
        return row is not None and row[0] == "ok"

    def teardown(self, pair: Pair) -> None:
        PROCS.stop(self.worker)
        PROCS.stop(self.ticker)
        self.worker = self.ticker = None

    def log_text(self) -> str:
        p = self.dir / "leaf.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def batches_since(self, offset: int) -> list[tuple[int, float]]:
        """The worker's batch lines written after `offset` bytes of its log: (events, seconds)."""
        text = self.log_text()[offset:]
        return [
            (int(m.group(1)), float(m.group(3)))
            for m in re.finditer(r"(?<!: )\{count: (\d+), ignored: (\d+), duration: ([0-9.]+)[,}]", text)
        ]


class PgCascadeLogical(PgCascade):
    """pgcascade with logical capture on the root: a slot read by the capture daemon (W1, W2b)."""

    label = "pgcascade, logical capture"
    key = "pgcascade-logical"
    workloads = frozenset({"W1", "W2b"})

    def __init__(self, env: Env):
        super().__init__(env)
        self.dir = env.work / "pgcascade-logical"
        self.capture: subprocess.Popen | None = None

    def create_root(self) -> None:
        self.cli(self.root_ini, "create-root", "root", "--capture=logical")

    def setup(self, pair: Pair, tables: list[str], copy: bool = False) -> None:
        super().setup(pair, tables, copy)
        self.capture = PROCS.start([*PGCASCADE, str(self.root_ini), "capture"], self.dir / "capture.out")

    def teardown(self, pair: Pair) -> None:
        super().teardown(pair)
        PROCS.stop(self.capture)
        self.capture = None
        with contextlib.suppress(psycopg.Error), pair.pconn() as conn:
            # DROP DATABASE would drop it too, but not while the walsender is still going away
            conn.execute(
                "select pg_drop_replication_slot(slot_name) from pg_replication_slots where database = %s",
                (pair.name,),
            )


class LogicalCaptureOnly(System):
    """W1 diagnostic: the capture daemon alone on the provider (no ticker, no worker)."""

    label = "pgcascade, logical capture only"
    key = "pgcascade-logical-capture"

    def __init__(self, env: Env):
        super().__init__(env)
        self.pgc = PgCascadeLogical(env)

    def setup(self, pair: Pair, tables: list[str], copy: bool = False) -> None:
        self.pgc.setup(pair, tables, copy)
        PROCS.stop(self.pgc.worker)
        PROCS.stop(self.pgc.ticker)

    def teardown(self, pair: Pair) -> None:
        self.pgc.teardown(pair)


class Londiste(System):
    label = "Londiste 3"
    key = "londiste"

    def __init__(self, env: Env):
        super().__init__(env)
        self.pgqd: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.dir = env.work / "londiste"

    def ini(self, name: str, db: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{name}.ini"
        path.write_text(
            "[londiste]\n"
            f"job_name = {name}\ndb = {db}\nqueue_name = {QUEUE}\n"
            f"logfile = {self.dir}/{name}.log\npidfile = {self.dir}/{name}.pid\n"
            f"loop_delay = {LONDISTE_LOOP_DELAY}\n"
        )
        return path

    def cli(self, ini: Path, *args: str) -> str:
        return run([*LONDISTE, str(ini), *args], timeout=300).stdout

    def setup(self, pair: Pair, tables: list[str], copy: bool = False) -> None:
        for connect in (pair.pconn, pair.sconn):
            with connect() as conn:
                conn.execute("create extension if not exists pgq")
                conn.execute("create extension if not exists pgq_node")
                conn.execute("create extension if not exists londiste")
        self.root_ini = self.ini(f"root_{pair.name}", pair.prov)
        self.leaf_ini = self.ini(f"leaf_{pair.name}", pair.sub)
        self.cli(self.root_ini, "create-root", "root", pair.prov)
        self.cli(self.leaf_ini, "create-leaf", "leaf", pair.sub, f"--provider={pair.prov}")
        if copy:
            # its copy waits for a tick at each state change; with no writes the queue ticks only
            # every ticker_idle_period (60 s by default)
            with pair.pconn() as conn:
                conn.execute("select pgq.set_queue_config(%s, 'ticker_idle_period', '1 second')", (QUEUE,))
        self.cli(self.root_ini, "add-table", *tables)
        if not copy:
            self.cli(self.leaf_ini, "add-table", *tables, "--expect-sync")
        pgqd_ini = self.dir / f"pgqd_{pair.name}.ini"
        pgqd_ini.write_text(
            "[pgqd]\n"
            f"base_connstr = {self.env.base_connstr(self.env.prov)}\n"
            "initial_database = postgres\n"
            f"database_list = {pair.name}\n"
            f"logfile = {self.dir}/pgqd.log\npidfile = {self.dir}/pgqd.pid\n"
            f"ticker_period = {PGQD_TICKER_PERIOD}\n"
        )
        self.pgqd = PROCS.start([PGQD, str(pgqd_ini)], self.dir / "pgqd.out")
        self.start_consumer(pair)

    def start_consumer(self, pair: Pair) -> None:
        self.worker = PROCS.start([*LONDISTE, str(self.leaf_ini), "worker"], self.dir / "worker.out")

    def stop_consumer(self, pair: Pair) -> None:
        PROCS.stop(self.worker)
        self.worker = None

    def add_table_timed(self, pair: Pair, table: str) -> None:
        self.cli(self.leaf_ini, "add-table", table)

    def in_sync(self, pair: Pair, table: str) -> bool:
        with pair.sconn() as conn:
            row = conn.execute(
                "select merge_state from londiste.table_info where table_name = %s", (f"public.{table}",)
            ).fetchone()
        return row is not None and row[0] == "ok"

    def teardown(self, pair: Pair) -> None:
        PROCS.stop(self.worker)
        PROCS.stop(self.pgqd)
        self.worker = self.pgqd = None


class Native(System):
    label = "native"
    key = "native"

    def setup(self, pair: Pair, tables: list[str], copy: bool = False) -> None:
        with pair.pconn() as conn:
            conn.execute(f"create publication bench_pub for table {', '.join(tables)}")
        if not copy:
            self.subscribe(pair, copy_data=False)

    def subscribe(self, pair: Pair, copy_data: bool) -> None:
        with pair.sconn() as conn:
            conn.execute(
                f"create subscription bench_sub connection '{pair.prov}' publication bench_pub"
                f" with (copy_data = {'true' if copy_data else 'false'})"
            )

    def stop_consumer(self, pair: Pair) -> None:
        with pair.sconn() as conn:
            conn.execute("alter subscription bench_sub disable")
            deadline = time.monotonic() + 30
            while conn.execute(
                "select count(*) from pg_stat_subscription where subname = 'bench_sub' and pid is not null"
            ).fetchone()[0]:
                if time.monotonic() > deadline:
                    raise RuntimeError("native: the apply worker did not stop")
                time.sleep(0.05)

    def start_consumer(self, pair: Pair) -> None:
        with pair.sconn() as conn:
            conn.execute("alter subscription bench_sub enable")

    def add_table_timed(self, pair: Pair, table: str) -> None:
        self.subscribe(pair, copy_data=True)

    def in_sync(self, pair: Pair, table: str) -> bool:
        with pair.sconn() as conn:
            states = conn.execute(
                "select r.srsubstate from pg_subscription_rel r join pg_subscription s on s.oid = r.srsubid"
                " where s.subname = 'bench_sub'"
            ).fetchall()
        return bool(states) and all(s[0] == "r" for s in states)

    def teardown(self, pair: Pair) -> None:
        with pair.sconn() as conn:
            exists = conn.execute("select 1 from pg_subscription where subname = 'bench_sub'").fetchone()
            if exists:
                conn.execute("drop subscription bench_sub")


# --- the workloads -------------------------------------------------------------------------------


@dataclass
class Results:
    w1: dict[str, list[float]] = field(default_factory=dict)  # system key -> tps per round
    w2a: dict[tuple[str, int], dict] = field(default_factory=dict)  # (system, txns) -> figures
    w2b: dict[tuple[str, int], dict] = field(default_factory=dict)  # (system, tps) -> figures
    w3: dict[tuple[str, int], dict] = field(default_factory=dict)  # (system or reference, rows) -> figures
    w4: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def fresh_pair(env: Env, name: str, template: str) -> Pair:
    pair = Pair(env, name)
    clone(env.prov, template, name)
    clone(env.sub, template, name)
    return pair


def run_w1(env: Env, systems: list[System], res: Results, seconds: int, rounds: int) -> None:
    everyone: list[System] = [NoReplication(env), *systems]
    if any(s.key == "pgcascade" for s in systems):
        everyone.append(CaptureOnly(env))
    if any(s.key == "pgcascade-logical" for s in systems):
        everyone.append(LogicalCaptureOnly(env))
    for rnd in range(rounds):
        order = everyone[rnd % len(everyone) :] + everyone[: rnd % len(everyone)]
        for s in order:
            pair = fresh_pair(env, f"w1_{s.key}", "tmpl10")
            try:
                s.setup(pair, PGBENCH_TABLES)
                time.sleep(1)
                checkpoint(env.prov, env.sub)
                tps = pgbench_run(env.prov, pair.name, "-c2", "-j2", f"-T{seconds}")
                res.w1.setdefault(s.key, []).append(tps)
                log(f"W1 round {rnd + 1} {s.label}: {tps:,.0f} tps")
            finally:
                s.teardown(pair)
                pair.drop()


W2_POLL = (
    "select (select count(*) from pgbench_history), (select max(hid) from pgbench_history),"
    " (select sum(tbalance) from pgbench_tellers), (select sum(bbalance) from pgbench_branches)"
)
ACCOUNTS_SUM = "select sum(abalance), count(*) from pgbench_accounts"


def catch_up(s: System, pair: Pair, txns: int, timeout: float = 900) -> dict:
    """W2a: a backlog of `txns` transactions made with the consumer stopped, then the catch-up."""
    s.stop_consumer(pair)
    pgbench_run(pair.env.prov, pair.name, "-N", "-c2", "-j2", f"-t{txns // 2}")
    with pair.pconn() as conn:
        want = conn.execute(W2_POLL).fetchone()
        want_accounts = conn.execute(ACCOUNTS_SUM).fetchone()
    checkpoint(pair.env.prov, pair.env.sub)
    log_offset = len(s.log_text()) if isinstance(s, PgCascade) else 0
    with pair.sconn() as conn:
        started = time.monotonic()
        s.start_consumer(pair)
        while True:
            # accounts (a scan of 1M rows) only once the rest is there: a system that commits
            # tables apart (pgcascade's parallel apply) is done when every table is
            got = conn.execute(W2_POLL).fetchone()
            if got == want and conn.execute(ACCOUNTS_SUM).fetchone() == want_accounts:
                break
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"{s.label}: not caught up after {timeout}s: {got} != {want}")
            time.sleep(0.05)
        secs = time.monotonic() - started
    out = {"secs": secs, "rows": 2 * txns, "rate": 2 * txns / secs}
    if isinstance(s, PgCascade):
        out["batches"] = s.batches_since(log_offset)
    return out


def percentile(values: list[float], p: float) -> float:
    v = sorted(values)
    k = (len(v) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def lag_run(s: System, pair: Pair, seconds: int, rate: int) -> dict:
    """W2b: heartbeat lag while pgbench -N runs at `rate` tps."""
    env = pair.env
    stop = threading.Event()
    sent: list[tuple[datetime.datetime, float]] = []  # (value written, monotonic commit time)
    seen: list[tuple[datetime.datetime, float]] = []  # (value read, monotonic time)
    errors: list[BaseException] = []
    beating = threading.Event()  # the heartbeat's last update is not in `sent` yet
    beating.set()

    def heartbeat() -> None:
        try:
            with pair.pconn() as conn:
                nxt = time.monotonic()
                while not stop.is_set():
                    v = datetime.datetime.now(datetime.UTC)
                    conn.execute("update heartbeat set t = %s where id = 1", (v,))
                    sent.append((v, time.monotonic()))
                    nxt += 0.05
                    time.sleep(max(0.0, nxt - time.monotonic()))
        except BaseException as e:
            errors.append(e)
        finally:
            beating.clear()

    def poller() -> None:
        try:
            with pair.sconn() as conn:
                last = None
                # on until the last update sent is seen (the heartbeat may be committing one
                # when `stop` is set: it was lost to the poller's last look before)
                while beating.is_set() or (sent and (last is None or last < sent[-1][0])):
                    v = conn.execute("select t from heartbeat where id = 1").fetchone()[0]
                    if v != last:
                        seen.append((v, time.monotonic()))
                        last = v
                    if stop.is_set() and time.monotonic() - stopped_at[0] > 30:
                        return
                    time.sleep(0.01)
        except BaseException as e:
            errors.append(e)

    stopped_at = [0.0]
    checkpoint(env.prov, env.sub)
    bench = subprocess.Popen(
        [
            PGBENCH,
            "-n",
            "-N",
            "-R",
            str(rate),
            "-c2",
            "-j2",
            f"-T{seconds}",
            *pgbench_args(env.prov, pair.name),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1)
    threads = [threading.Thread(target=heartbeat), threading.Thread(target=poller)]
    for t in threads:
        t.start()
    time.sleep(max(1, seconds - 2))
    stopped_at[0] = time.monotonic()
    stop.set()
    for t in threads:
        t.join()
    out, err = bench.communicate(timeout=seconds + 60)
    if errors:
        raise errors[0]
    if bench.returncode != 0:
        raise RuntimeError(f"pgbench: exit {bench.returncode}: {err}")
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
    lags = []
    j = 0
    for v, committed in sent:
        while j < len(seen) and seen[j][0] < v:
            j += 1
        if j == len(seen):
            raise RuntimeError(f"{s.label}: heartbeat {v} never reached the subscriber")
        lags.append(max(0.0, seen[j][1] - committed))
    return {
        "median": statistics.median(lags),
        "p95": percentile(lags, 0.95),
        "max": max(lags),
        "n": len(lags),
        "tps": float(m.group(1)) if m else float("nan"),
    }


def run_w2(
    env: Env,
    systems: list[System],
    res: Results,
    backlogs: list[int],
    rates: list[int],
    do_a: bool,
    do_b: bool,
    seconds: int,
) -> None:
    for s in systems:
        pair = fresh_pair(env, f"w2_{s.key}", "tmpl10")
        try:
            s.setup(pair, TABLES)
            time.sleep(1)
            if do_a:
                for txns in backlogs:
                    r = catch_up(s, pair, txns)
                    res.w2a[(s.key, txns)] = r
                    extra = ""
                    if "batches" in r:
                        b = r["batches"]
                        extra = f"; {len(b)} batches, apply {sum(d for _, d in b):.2f}s"
                    log(
                        f"W2a {s.label}: {txns:,} txns ({2 * txns:,} row changes) caught up in"
                        f" {r['secs']:.2f}s: {r['rate']:,.0f} rows/s{extra}"
                    )
            for rate in rates if do_b else []:
                r = lag_run(s, pair, seconds, rate)
                res.w2b[(s.key, rate)] = r
                log(
                    f"W2b {s.label} at {rate} tps: lag median {r['median'] * 1000:.1f} ms, p95 {r['p95'] * 1000:.1f} ms,"
                    f" max {r['max'] * 1000:.1f} ms ({r['n']} heartbeats, pgbench {r['tps']:.0f} tps)"
                )
        finally:
            s.teardown(pair)
            pair.drop()


def run_w3(env: Env, systems: list[System], res: Results, scale: int) -> None:
    # the reference: one pipe of two psql, into an unindexed table, then ADD PRIMARY KEY
    rows = scale * 100_000
    name = "w3_ref"
    clone(env.prov, f"tmpl{scale}", name)
    env.sub.create_database(name)
    try:
        with env.sub.connect(name) as conn:
            conn.execute(
                "create table pgbench_accounts (aid int not null, bid int, abalance int, filler char(84))"
                " with (fillfactor = 100)"
            )
        checkpoint(env.prov, env.sub)
        started = time.monotonic()
        out = subprocess.Popen(
            [PSQL, "-X", "-q", *psql_args(env.prov, name), "-c", f"\\copy {W3_TABLE} to stdout"],
            stdout=subprocess.PIPE,
        )
        into = subprocess.run(
            [PSQL, "-X", "-q", *psql_args(env.sub, name), "-v", "ON_ERROR_STOP=1", "-c", COPY_IN],
            stdin=out.stdout,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        out.stdout.close()
        out.wait(timeout=60)
        if into.returncode or out.returncode:
            raise RuntimeError(f"reference pipe failed: {into.stderr}")
        piped = time.monotonic()
        with env.sub.connect(name) as conn:
            conn.execute(f"alter table {W3_TABLE} add primary key (aid)")
            n = conn.execute(f"select count(*) from {W3_TABLE}").fetchone()[0]
        done = time.monotonic()
        res.w3[("reference", rows)] = {
            "secs": done - started,
            "copy": piped - started,
            "pk": done - piped,
            "rows": n,
        }
        log(
            f"W3 reference, {rows:,} rows: {done - started:.2f}s (pipe {piped - started:.2f}s, primary key {done - piped:.2f}s)"
        )
    finally:
        Pair(env, name).drop()

    for s in systems:
        pair = Pair(env, f"w3_{s.key}")
        clone(env.prov, f"tmpl{scale}", pair.name)
        clone(env.sub, f"tmpl{scale}_sub", pair.name)
        try:
            s.setup(pair, [W3_TABLE], copy=True)
            time.sleep(2)  # the daemons are up and idle
            checkpoint(env.prov, env.sub)
            log_offset = len(s.log_text()) if isinstance(s, PgCascade) else 0
            started = time.monotonic()
            s.add_table_timed(pair, W3_TABLE)
            added = time.monotonic()
            while not s.in_sync(pair, W3_TABLE):
                if time.monotonic() - started > 1200:
                    raise RuntimeError(f"{s.label}: {W3_TABLE} not in sync after 1200s")
                time.sleep(0.05)
            secs = time.monotonic() - started
            with pair.sconn() as conn:
                n = conn.execute(f"select count(*) from {W3_TABLE}").fetchone()[0]
            if n != rows:
                raise RuntimeError(f"{s.label}: {n} rows in {W3_TABLE} after the copy")
            r = {"secs": secs, "add": added - started, "rows": n}
            if isinstance(s, PgCascade):
                m = re.search(
                    r"copied (\d+) rows \(([0-9.]+) MB\) in ([0-9.]+)s, indexes and constraints in ([0-9.]+)s",
                    s.log_text()[log_offset:],
                )
                if m:
                    r["copy"], r["index"] = float(m.group(3)), float(m.group(4))
            res.w3[(s.key, rows)] = r
            log(
                f"W3 {s.label}, {rows:,} rows: in sync after {secs:.2f}s"
                + (f" (copy {r['copy']:.2f}s, index {r['index']:.2f}s)" if "copy" in r else "")
            )
        finally:
            s.teardown(pair)
            pair.drop()


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident set (VmHWM), in MB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def run_w4(env: Env, systems: list[System], res: Results) -> None:
    """One transaction updates every row of a 5,000,000-row table, with the consumers running:
    the time until the subscriber has it, and the pgcascade worker's peak RSS."""
    for s in systems:
        if isinstance(s, Londiste):
            log("W4 Londiste 3: skipped (5,000,000 single-row statements; not measured in this run)")
            continue
        pair = Pair(env, f"w4_{s.key}")
        clone(env.prov, "tmpl50", pair.name)
        clone(env.sub, "tmpl50", pair.name)
        try:
            s.setup(pair, [W3_TABLE])
            time.sleep(2)
            checkpoint(env.prov, env.sub)
            started = time.monotonic()
            with pair.pconn() as conn:
                conn.execute(W4_UPDATE)
                committed = time.monotonic()
                want = conn.execute(f"select sum(abalance) from {W3_TABLE}").fetchone()[0]
                probe = conn.execute(W4_PROBE).fetchone()[0]
            with pair.sconn() as conn:
                # every system applies the transaction in one transaction: one row has it when
                # all do (a sum over 5M rows every 0.5 s took a core from the apply); checked after
                while conn.execute(W4_PROBE).fetchone()[0] != probe:
                    if time.monotonic() - started > 3600:
                        raise RuntimeError(f"{s.label}: the 5M-row transaction not applied after 3600s")
                    time.sleep(0.05)
                done = time.monotonic()
                got = conn.execute(f"select sum(abalance) from {W3_TABLE}").fetchone()[0]
                if got != want:
                    raise RuntimeError(
                        f"{s.label}: W4 sum(abalance) {got} on the subscriber, {want} on the provider"
                    )
            r = {"secs": done - started, "write": committed - started, "after_commit": done - committed}
            if isinstance(s, PgCascade) and s.worker is not None:
                r["rss_mb"] = peak_rss_mb(s.worker.pid)
            res.w4[s.key] = r
            log(
                f"W4 {s.label}: the 5M-row transaction took {r['write']:.1f}s on the provider, on the"
                f" subscriber {r['after_commit']:.1f}s after its commit"
                + (f"; worker peak RSS {r['rss_mb']:.0f} MB" if r.get("rss_mb") else "")
            )
        finally:
            s.teardown(pair)
            pair.drop()


def psql_args(c: LocalCluster, dbname: str) -> list[str]:
    return ["-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres", "-d", dbname]


# --- reporting -----------------------------------------------------------------------------------


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
    londiste = run([*LONDISTE, "--version"], check=False).stdout.strip().splitlines()
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem} RAM, {platform.system()} {platform.release()};"
        f" PostgreSQL {pg}; {londiste[0] if londiste else 'londiste ?'};"
        f" psycopg {psycopg.__version__}; Python {platform.python_version()}"
    )


def source_info() -> str:
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
        return r.stdout if r.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD").strip()
    if not commit:
        return "pgcascade (not a git checkout)"
    changed = [line[3:] for line in git("status", "--porcelain", "src").splitlines()]
    return f"pgcascade at commit {commit}" + (
        f", with uncommitted changes in {', '.join(changed)}" if changed else ", src unchanged since"
    )


def fmt_ratio(x: float | None) -> str:
    return NA if x is None else f"{x:.2f}"


def report(res: Results, systems: list[System], args: argparse.Namespace) -> list[str]:
    peers = [s for s in systems if not s.key.startswith("pgcascade")]
    keys = [s.key for s in systems]
    head = ["figure", "unit", "no replication / reference", *[s.label for s in systems]]
    head += [f"pgcascade vs {p.label}" for p in peers] + ["goal", "met"]
    out = [
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * 2 + " ---: |" * (1 + len(systems) + len(peers)) + " --- | --- |",
    ]

    def row(fig, unit, ref, vals: dict[str, float | None], fmt, better_high: bool, goal="", met=""):
        cells = [fig, unit, ref]
        for k in keys:
            v = vals.get(k)
            cells.append(NA if v is None else fmt(v))
        ours = vals.get("pgcascade")
        for p in peers:
            theirs = vals.get(p.key)
            if ours is None or theirs is None or not ours or not theirs:
                cells.append(NA)
            else:
                cells.append(fmt_ratio(ours / theirs if better_high else theirs / ours))
        cells += [goal, met]
        out.append("| " + " | ".join(cells) + " |")

    goals: list[tuple[str, bool | None]] = []
    if res.w1:
        med = {k: statistics.median(v) for k, v in res.w1.items()}
        base = med.get("none")
        row(
            f"W1 TPC-B TPS on the provider, `-c2 -j2 -T{args.w1_seconds}` ({args.rounds} runs, median)",
            "tps",
            f"{base:,.0f}" if base else NA,
            med,
            lambda v: f"{v:,.0f}",
            True,
        )
        if base:
            ok_logical: bool | None = None
            ratios = {k: v / base for k, v in med.items() if k != "none"}
            ok = ratios.get("pgcascade", 0) >= ratios.get("londiste", 0)
            goals.append(("W1 TPS ratio with trigger capture >= Londiste's", ok))
            if "pgcascade-logical" in ratios and "native" in ratios:
                ok_logical = ratios["pgcascade-logical"] >= ratios["native"]
                goals.append(("W1 TPS ratio with logical capture >= native's", ok_logical))
            row(
                "W1 TPS ratio to no replication",
                "ratio",
                "1.00",
                ratios,
                lambda v: f"{v:.2f}",
                True,
                ">= Londiste (trigger), >= native (logical)",
                "yes" if ok and (ok_logical is not False) else "**no**",
            )
    for txns in sorted({t for _, t in res.w2a}, reverse=True):
        vals = {k: res.w2a[(k, txns)]["rate"] for k in keys if (k, txns) in res.w2a}
        secs = {k: res.w2a[(k, txns)]["secs"] for k in keys if (k, txns) in res.w2a}
        goal_here = txns == max(t for _, t in res.w2a) and "native" in vals
        ok = vals.get("pgcascade", 0) >= 1.5 * vals.get("native", float("inf"))
        if goal_here:
            goals.append((f"W2a catch-up ({txns:,} txns) >= 1.5x native", ok))
        row(
            f"W2a catch-up of {txns:,} txns ({2 * txns:,} row changes)",
            "row changes/s",
            NA,
            vals,
            lambda v: f"{v / 1000:,.1f}k",
            True,
            ">= 1.5x native" if goal_here else "",
            ("yes" if ok else "**no**") if goal_here else "",
        )
        row(f"W2a catch-up of {txns:,} txns: time", "s", NA, secs, lambda v: f"{v:.2f}", False)
    for rate in sorted({r for _, r in res.w2b}):
        for stat in ("median", "p95", "max"):
            vals = {k: res.w2b[(k, rate)][stat] * 1000 for k in keys if (k, rate) in res.w2b}
            ours = vals.get("pgcascade", float("inf"))
            goal, ok = "", None  # median and p95 at every rate: within 1.5x native's
            if stat in ("median", "p95") and "native" in vals:
                goal, ok = "<= 1.5x native", ours <= 1.5 * vals["native"]
                goals.append((f"W2b lag at {rate:,} tps, {stat} {goal}", ok))
            row(
                f"W2b lag at {rate:,} tps, {stat}",
                "ms",
                NA,
                vals,
                lambda v: f"{v:,.1f}",
                False,
                goal,
                ("yes" if ok else "**no**") if goal else "",
            )
    for rows in sorted({n for _, n in res.w3}):
        ref = res.w3.get(("reference", rows), {}).get("secs")
        vals = {k: res.w3[(k, rows)]["secs"] for k in keys if (k, rows) in res.w3}
        row(
            f"W3 {rows:,} rows ({rows * 128 // 1_000_000:,} MB) into an empty table until in sync",
            "s",
            f"{ref:.2f}" if ref else NA,
            vals,
            lambda v: f"{v:.2f}",
            False,
        )
        if ref:
            ratios = {k: v / ref for k, v in vals.items()}
            ok = ratios.get("pgcascade", float("inf")) <= 1.05
            goals.append(
                (f"W3 ({rows:,} rows) in sync within 1.05x of the pipe + ADD PRIMARY KEY reference", ok)
            )
            row(
                f"W3 {rows:,} rows: time / reference",
                "ratio",
                "1.00",
                ratios,
                lambda v: f"{v:.2f}",
                False,
                "<= 1.05",
                "yes" if ok else "**no**",
            )
    if res.w4:
        for fig, key in (("on the subscriber after its commit", "after_commit"), ("in all", "secs")):
            vals = {k: res.w4[k][key] for k in keys if k in res.w4}
            goal, ok = "", None
            if key == "after_commit" and "native" in vals:
                goal, ok = "<= 1.2x native", vals.get("pgcascade", float("inf")) <= 1.2 * vals["native"]
                goals.append((f"W4 on the subscriber after its commit {goal}", ok))
            row(
                f"W4 one transaction updating 5,000,000 rows: {fig}",
                "s",
                NA,
                vals,
                lambda v: f"{v:.1f}",
                False,
                goal,
                ("yes" if ok else "**no**") if goal else "",
            )
        rss = res.w4.get("pgcascade", {}).get("rss_mb")
        if rss:
            goals.append(("W4 worker peak RSS <= 500 MB", rss <= 500))
            row(
                "W4 pgcascade worker peak RSS",
                "MB",
                NA,
                {"pgcascade": rss},
                lambda v: f"{v:,.0f}",
                False,
                "<= 500 MB",
                "yes" if rss <= 500 else "**no**",
            )
    lines = [*out, "", "Goals (pgcascade):", ""]
    lines += [f"- {g}: {'met' if ok else '**not met**'}" for g, ok in goals]
    return lines


def details(res: Results) -> list[str]:
    out = []
    if res.w1:
        out.append(
            "- W1 each run, tps (rounds rotate the order): "
            + "; ".join(f"{k}: {', '.join(f'{v:,.0f}' for v in vs)}" for k, vs in res.w1.items())
        )
        if "pgcascade-capture" in res.w1 and "none" in res.w1:
            cap, base = statistics.median(res.w1["pgcascade-capture"]), statistics.median(res.w1["none"])
            out.append(
                f"- W1 diagnostic, pgcascade's capture triggers alone (no ticker, no worker): {cap:,.0f} tps,"
                f" {cap / base:.2f} of no replication"
            )
        if "pgcascade-logical-capture" in res.w1 and "none" in res.w1:
            cap = statistics.median(res.w1["pgcascade-logical-capture"])
            base = statistics.median(res.w1["none"])
            out.append(
                f"- W1 diagnostic, pgcascade's logical capture daemon alone (no ticker, no worker): {cap:,.0f} tps,"
                f" {cap / base:.2f} of no replication"
            )
    for (_k, txns), r in sorted(res.w2a.items()):
        if "batches" in r:
            b = r["batches"]
            out.append(
                f"- W2a pgcascade {txns:,} txns: {r['secs']:.2f}s in all; {len(b)} batches (events, apply seconds):"
                f" {', '.join(f'{n:,} in {d:.2f}s' for n, d in b)}; time outside the batches"
                f" (start-up, waiting, polling): {r['secs'] - sum(d for _, d in b):.2f}s"
            )
    for (k, rate), r in res.w2b.items():
        out.append(f"- W2b {k} at {rate:,} tps: {r['n']} heartbeats, pgbench ran at {r['tps']:.0f} tps")
    for (k, rows), r in res.w3.items():
        parts = ", ".join(f"{n} {v:.2f}s" for n, v in r.items() if n not in ("secs", "rows"))
        out.append(f"- W3 {k}, {rows:,} rows: {r['secs']:.2f}s ({parts})")
    return out


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: W1 runs 10 s, W2a catches up 20k transactions only",
    )
    ap.add_argument("--only", default=",".join(ALL_WORKLOADS), help="workloads to run: W1,W2a,W2b,W3,W4")
    ap.add_argument(
        "--systems",
        default="pgcascade,pgcascade-logical,londiste,native",
        help="systems to measure (pgcascade-logical: W1 only)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help="W1 runs per system, the order rotating; the median is reported (default 3, --quick 1)",
    )
    ap.add_argument(
        "--backlogs",
        default="1000000",
        help="W2a backlogs, in transactions; the goal is judged on the largest (1,000,000: ~15 min of"
        " pgbench per system; 100000,20000,10000 for quicker ones)",
    )
    ap.add_argument("--lag-rates", default="500,2000", help="W2b: the pgbench rates (tps) to measure lag at")
    ap.add_argument(
        "--w3-scales",
        default="50,200",
        help="W3: pgbench scales of the copied table (50 = 5M rows, 200 = 20M rows, ~2.6 GB)",
    )
    ap.add_argument(
        "--leaf-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a leaf ini key other than its default (repeatable), named in the report: its figures are not the shipped defaults'",
    )
    ap.add_argument("--report", type=Path, help="also write the results as Markdown to this file")
    ap.add_argument("--keep-logs", action="store_true", help="keep the daemons' configs and logs")
    args = ap.parse_args(argv)
    for kv in args.leaf_setting:
        key, eq, value = kv.partition("=")
        if not eq:
            ap.error(f"--leaf-setting {kv!r}: KEY=VALUE expected")
        PGC_LEAF[key.strip()] = value.strip()
    only = {w.strip() for w in args.only.split(",") if w.strip()}
    if only - set(ALL_WORKLOADS):
        ap.error(f"unknown workloads {sorted(only - set(ALL_WORKLOADS))}: choose from {ALL_WORKLOADS}")
    args.w1_seconds = 10 if args.quick else 30
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    w2b_seconds = 30
    backlogs = [20_000] if args.quick else sorted({int(b) for b in args.backlogs.split(",")}, reverse=True)
    rates = [500] if args.quick else sorted({int(r) for r in args.lag_rates.split(",")})
    w3_scales = sorted({int(x) for x in args.w3_scales.split(",")})
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "londiste" in wanted and not (Path(LONDISTE[1]).exists() and Path(PGQD).exists()):
        print(
            "Londiste 3 is not installed: run `bash bench/install-peers.sh` (as root) first", file=sys.stderr
        )
        return 2

    load_start = os.getloadavg()
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd() + "/") else "python"
    command = " ".join(shlex.quote(a) for a in [python, sys.argv[0], *(argv or sys.argv[1:])])
    started = datetime.datetime.now().astimezone()
    source = source_info()
    work = ROOT / "bench" / "work" / f"replication-{started:%Y%m%d-%H%M%S}"
    work.mkdir(parents=True)
    base = Path(tempfile.mkdtemp(prefix="pgcascade-replbench-"))
    common = {"shared_buffers": "1GB"}
    log(f"starting two clusters (fsync and synchronous_commit on, shared_buffers 1GB); logs in {work}")
    prov = new_cluster("provider", basedir=base, fast_unsafe=False, settings=common)
    sub = new_cluster(
        "subscriber",
        basedir=base,
        fast_unsafe=False,
        settings={**common, "wal_retrieve_retry_interval": "'100ms'"},
    )
    env = Env(prov, sub, work)
    res = Results()
    classes = {
        "pgcascade": PgCascade,
        "pgcascade-logical": PgCascadeLogical,
        "londiste": Londiste,
        "native": Native,
    }
    systems = [classes[k](env) for k in wanted]
    try:
        with prov.connect() as conn:
            machine = machine_info(conn)
        if only & {"W1", "W2a", "W2b"}:
            log("making the scale-10 templates")
            make_template(prov, "tmpl10", 10)
            make_template(sub, "tmpl10", 10)
        if "W1" in only:
            run_w1(env, systems, res, args.w1_seconds, args.rounds)
        full = [s for s in systems if s.workloads is None]
        if only & {"W2a", "W2b"}:
            run_w2(env, full, res, backlogs, rates, "W2a" in only, "W2b" in only, w2b_seconds)
            lag_only = [s for s in systems if s.workloads and "W2b" in s.workloads]
            if "W2b" in only and lag_only:
                run_w2(env, lag_only, res, [], rates, False, True, w2b_seconds)
        if only & {"W3", "W4"}:
            log("making the scale-50 template")
            with contextlib.suppress(psycopg.Error):
                for c in (prov, sub):
                    with c.connect() as conn:
                        conn.execute("drop database if exists tmpl10")
            make_template(prov, "tmpl50", 50)
        for scale in w3_scales if "W3" in only else []:
            if scale != 50:
                make_template(prov, f"tmpl{scale}", scale)
            make_w3_subscriber_template(sub, f"tmpl{scale}_sub")
            run_w3(env, full, res, scale)
            for c, db in ((sub, f"tmpl{scale}_sub"), (prov, f"tmpl{scale}" if scale != 50 else "")):
                if db:
                    with contextlib.suppress(psycopg.Error), c.connect() as conn:
                        conn.execute(f"drop database if exists {db}")
        if "W4" in only:
            make_template(sub, "tmpl50", 50)
            run_w4(env, full, res)
        load = os.getloadavg()
        elapsed = datetime.datetime.now().astimezone() - started
    finally:
        PROCS.close()
        for c in (prov, sub):
            c.destroy()
        shutil.rmtree(base, ignore_errors=True)
        if not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)

    changed = [
        f"{what} {k}={v}"
        for what, keys in (("leaf ini", PGC_LEAF), ("ticker ini", PGC_TICKER), ("queue config", PGC_QUEUE))
        for k, v in keys.items()
    ]
    pgc_settings = (
        ", ".join(changed) if changed else "its shipped defaults, one configuration for every figure"
    )
    lines = [
        f"# Replication benchmark: pgcascade vs Londiste 3 vs native logical replication ({started:%Y-%m-%d %H:%M %Z})",
        "",
        f"- machine: {machine}; load average (1, 5, 15 min) at the start {load_start[0]:.2f} {load_start[1]:.2f}"
        f" {load_start[2]:.2f}, at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        f"- source: {source}",
        f"- command: `{command}` ({elapsed.total_seconds() / 60:.1f} minutes)",
        "- clusters: two fresh throwaway clusters (provider, subscriber) on 127.0.0.1, wal_level=logical,"
        " shared_buffers=1GB, fsync on, synchronous_commit on; the subscriber has"
        " wal_retrieve_retry_interval=100ms; each system works in databases of its own, cloned from one"
        " template (pgbench scale 10, or 50 for W3, `pgbench_history` with `hid bigserial primary key`);"
        " CHECKPOINT on both before each timed phase; pgbench always -n",
        f"- pgcascade: {pgc_settings}; the leaf tables added with --expect-sync (W1, W2), without (W3)",
        f"- Londiste 3: /usr/bin/londiste with the system Python; worker loop_delay={LONDISTE_LOOP_DELAY};"
        f" pgqd ticker_period={PGQD_TICKER_PERIOD} and the queue's default thresholds (W3: ticker_idle_period"
        " 1 second); no worker on the root; leaf tables --expect-sync (W1, W2)",
        "- native: CREATE PUBLICATION for the tables; CREATE SUBSCRIPTION with copy_data=false (W1, W2),"
        " copy_data=true (W3, timed from CREATE SUBSCRIPTION); W2a stops it with ALTER SUBSCRIPTION DISABLE",
        "- W2b: heartbeat updated every 50 ms for the run's middle 28 s, subscriber polled every 10 ms",
        "",
        "Ratios `pgcascade vs X`: above 1 means pgcascade is better (throughput pgcascade/X, times X/pgcascade).",
        "",
        *report(res, systems, args),
        "",
        "Details:",
        "",
        *details(res),
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
