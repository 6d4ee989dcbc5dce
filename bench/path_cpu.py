#!/usr/bin/env python3
"""The change path's lag and CPU per replicated transaction, by system, at a steady rate.

A diagnostic beside `replication_bench.py` (whose systems, clusters and heartbeat method it
reuses): two fresh clusters as there (fsync and synchronous_commit on), pgbench scale 10, and
one system replicating the pgbench tables and the heartbeat with its shipped defaults.  Then
`pgbench -n -c2 -j2 -R RATE -T SECONDS` (`-N` unless `--tpcb`; `--rate 0`: flat out) runs on
the provider while the heartbeat lag is measured (W2b's method), and the CPU time of every
process involved is read from `/proc` before and after: each cluster's server processes
(backends, walsenders, background processes; exited ones through the postmaster's children
counters) and the system's own daemons.  CPU per transaction does not depend on the machine's
other load the way wall-clock figures do, so it is what designs are compared by here.

The writers' backends (pgbench's sessions) are shown apart (`writers`: the capture triggers run
there), with how they were found at each sample (idle between transactions, running, waiting on
what: a closed-loop load is almost never idle, a rate-limited one often), and left out of
`provider`: their CPU is sampled while they live, and the provider's is read once the
postmaster has reaped them (before, it was read whether they had been reaped or not, so
`provider` held them in some runs and not in others: 600 against 1,050 µs a transaction at
500 tps).  The provider's WAL written per transaction is printed too, and how often each
cluster flushed its WAL a second (pg_stat_wal).  `--split` breaks both servers' CPU down by kind
of process (backend_type and application_name, sampled as the writers are); `--statements`
loads pg_stat_statements (track = all) on both and prints the statements that took most of
their time, nested ones included.  `londiste` is Londiste 3 as replication_bench.py runs it
(pgqd counted as its ticker), `capture` pgcascade's capture triggers alone (no worker, no
ticker).

    .venv/bin/python bench/path_cpu.py [--system pgcascade|pgcascade-logical|native|londiste|capture|none]
                                       [--rate 500] [--seconds 20] [--tpcb] [--rounds 1]
                                       [--split] [--statements] [--leaf KEY=VALUE ...]

`--leaf` sets a key of pgcascade's leaf ini (`--leaf pace_max=0.05 --leaf pace_pressure=1`): a
variant to compare with the shipped defaults, run after run in the same hour.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replication_bench as rb

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int, children: bool = False) -> float:
    """CPU seconds of a process (with `children`: also of its exited, waited-for children)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    t = int(f[11]) + int(f[12])
    if children:
        t += int(f[13]) + int(f[14])
    return t / TICK


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int(d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def postmaster_pid(c: rb.LocalCluster) -> int:
    return int((c.datadir / "postmaster.pid").read_text().splitlines()[0])


def tree_cpu(pid: int) -> float:
    """A process and every process below it, exited ones included."""
    return proc_cpu(pid, children=True) + sum(tree_cpu(c) for c in children_of(pid))


class Meter:
    """CPU seconds of named process trees, between start() and stop()."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.before: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        return {k: tree_cpu(p) for k, p in self.pids.items()}

    def start(self) -> None:
        self.before = self.read()

    def stop(self) -> dict[str, float]:
        after = self.read()
        return {k: after[k] - self.before[k] for k in self.pids}


class HostLoad:
    """The host's CPU pressure (PSI `some`: the share of time a task waited for a CPU) and its
    idle, iowait and steal shares of all CPUs, between start() and stop(): what a pacer could read."""

    def read(self) -> tuple[float, list[int]]:
        try:
            psi = int(Path("/proc/pressure/cpu").read_text().split("total=", 1)[1].split()[0]) / 1e6
        except (OSError, IndexError, ValueError):
            psi = float("nan")
        cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return psi, cpu

    def start(self) -> None:
        self.at, (self.psi, self.cpu) = time.monotonic(), self.read()

    def stop(self) -> str:
        secs = time.monotonic() - self.at
        psi, cpu = self.read()
        d = [b - a for a, b in zip(self.cpu, cpu, strict=False)]
        total = sum(d[:8]) or 1
        return (
            f"host: CPU pressure {100 * (psi - self.psi) / secs:.0f} %, idle {100 * d[3] / total:.0f} %,"
            f" iowait {100 * d[4] / total:.0f} %, steal {100 * d[7] / total:.0f} %"
        )


# each writer's backend and what it was doing (a wait event names what it waits on; none while
# active: on a CPU or queued for one)
WRITER_STATES = (
    "select pid, case when state = 'active' then coalesce(wait_event_type || ':' || wait_event, 'running')"
    " else state end from pg_stat_activity where application_name = 'pgbench'"
)


class Writers:
    """The CPU of pgbench's backends on the provider: sampled while they live (the last value
    seen of each), so that it can be told apart from the provider's other processes.  The
    other server processes of both clusters are sampled too, by kind (`split`)."""

    def __init__(self, c: rb.LocalCluster, dbname: str, others: Sequence[rb.LocalCluster] = ()):
        self.conninfo = c.connstr(dbname)
        self.others = [(o.name, o.connstr("postgres")) for o in others]
        self.seen: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.kind: dict[int, str] = {}
        self.states: dict[str, int] = {}  # the writers' states seen, by how often
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def pids(self, conn: psycopg.Connection) -> list[int]:
        return [
            r[0] for r in conn.execute("select pid from pg_stat_activity where application_name = 'pgbench'")
        ]

    def sample(self) -> None:
        conns = [(n, psycopg.connect(ci, autocommit=True)) for n, ci in self.others]
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                while not self.stop.is_set():
                    for pid, state in conn.execute(WRITER_STATES):
                        self.seen[pid] = max(self.seen.get(pid, 0.0), proc_cpu(pid))
                        self.states[state] = self.states.get(state, 0) + 1
                    for name, c in conns:
                        for pid, kind in c.execute(
                            "select pid, backend_type || coalesce(' ' || nullif(application_name, ''), '')"
                            " from pg_stat_activity where application_name <> 'pgbench'"
                        ):
                            cpu = proc_cpu(pid)
                            self.first.setdefault(pid, cpu)
                            self.kind[pid] = f"{name}: {kind}"
                            self.seen[-pid] = max(self.seen.get(-pid, 0.0), cpu)
                    self.stop.wait(0.1)
        finally:
            for _, c in conns:
                c.close()

    def state_shares(self) -> str:
        """How the writers' backends were found: idle (waiting for their client's next
        transaction), running, or waiting on what."""
        n = sum(self.states.values()) or 1
        return ", ".join(
            f"{k} {100 * v / n:.0f} %" for k, v in sorted(self.states.items(), key=lambda kv: -kv[1])
        )

    def split(self) -> dict[str, float]:
        """CPU seconds of the other server processes seen, by cluster and kind."""
        out: dict[str, float] = {}
        for pid, kind in self.kind.items():
            out[kind] = out.get(kind, 0.0) + self.seen[-pid] - self.first[pid]
        return out

    def __enter__(self) -> Writers:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def wait_gone(self, timeout: float = 10.0) -> None:
        """Until no writer's backend is left (the postmaster has counted them as its children's)."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while self.pids(conn) or any(Path(f"/proc/{p}").exists() for p in self.seen):
                if time.monotonic() > deadline:
                    raise RuntimeError("pgbench's backends did not exit")
                time.sleep(0.05)

    def cpu(self) -> float:
        return sum(v for p, v in self.seen.items() if p > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", default="pgcascade")
    ap.add_argument("--rate", type=int, default=500, help="pgbench tps (0: flat out)")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--tpcb", action="store_true", help="TPC-B-like transactions (W1's), not -N")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--split", action="store_true", help="the servers' CPU by kind of process too")
    ap.add_argument(
        "--statements", action="store_true", help="pg_stat_statements (track = all): the costliest statements"
    )
    ap.add_argument(
        "--leaf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a key of pgcascade's leaf ini instead of its default (a variant to compare; repeatable)",
    )
    args = ap.parse_args()
    for kv in args.leaf:
        key, sep, value = kv.partition("=")
        if not sep or not key.strip():
            ap.error(f"--leaf {kv!r}: expected KEY=VALUE")
        rb.PGC_LEAF[key.strip()] = value.strip()

    base = Path(tempfile.mkdtemp(prefix="pgcascade-path-cpu-"))
    os.chmod(base, 0o777)
    common = {"shared_buffers": "1GB"}
    if args.statements:
        common.update({"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"})
    prov = rb.new_cluster("provider", basedir=base, fast_unsafe=False, settings=common)
    sub = rb.new_cluster(
        "subscriber",
        basedir=base,
        fast_unsafe=False,
        settings={**common, "wal_retrieve_retry_interval": "'100ms'"},
    )
    env = rb.Env(prov, sub, base / "work")
    systems = {
        "pgcascade": rb.PgCascade,
        "pgcascade-logical": rb.PgCascadeLogical,
        "native": rb.Native,
        "londiste": rb.Londiste,
        "capture": rb.CaptureOnly,
        "none": rb.NoReplication,
    }
    try:
        rb.make_template(prov, "tmpl10", 10)
        rb.make_template(sub, "tmpl10", 10)
        for rnd in range(args.rounds):
            s = systems[args.system](env)
            if isinstance(s, rb.PgCascade):
                s.ticker_settings, s.queue_settings = {}, {}  # the shipped defaults
            pair = rb.fresh_pair(env, f"p_{rnd}", "tmpl10")
            try:
                s.setup(pair, rb.TABLES)
                time.sleep(2)
                pids = {"provider": postmaster_pid(prov), "subscriber": postmaster_pid(sub)}
                for name in ("worker", "ticker", "capture", "pgqd"):
                    p = getattr(s, name, None)
                    if p is not None:
                        pids[name] = p.pid
                if args.statements:
                    for c in (prov, sub):
                        with psycopg.connect(c.connstr(pair.name), autocommit=True) as conn:
                            conn.execute("create extension if not exists pg_stat_statements")
                            conn.execute("select pg_stat_statements_reset()")
                meter = Meter(pids)
                writers = Writers(prov, pair.name, [prov, sub] if args.split else [])
                wal_before = wal_lsn(prov)
                syncs_before = [wal_syncs(c) for c in (prov, sub)]
                meter.start()
                host = HostLoad()
                host.start()
                started = time.monotonic()
                with writers:
                    r = lag_or_tps(s, pair, args)
                secs = time.monotonic() - started
                host_load = host.stop()
                wal = wal_lsn(prov) - wal_before
                syncs = [wal_syncs(c) - before for c, before in zip((prov, sub), syncs_before, strict=True)]
                writers.wait_gone()
                cpu = meter.stop()
                cpu["provider"] -= writers.cpu()
                cpu["writers"] = writers.cpu()
                txns = r["tps"] * args.seconds
                parts = ", ".join(f"{k} {1e6 * v / txns:.0f}" for k, v in cpu.items())
                total = sum(v for k, v in cpu.items() if k != "writers")
                lag = (
                    f"lag median {r['median'] * 1000:.1f} ms, p95 {r['p95'] * 1000:.1f}, max {r['max'] * 1000:.1f}; "
                    if "median" in r
                    else ""
                )
                print(
                    f"{args.system} round {rnd + 1}: {r['tps']:.0f} tps; {lag}CPU per transaction, µs:"
                    f" {parts}; all {1e6 * total / txns:.0f} ({total / secs:.2f} cores);"
                    f" provider WAL {wal / txns:.0f} bytes a transaction; WAL flushes a second:"
                    f" provider {syncs[0] / secs:.0f}, subscriber {syncs[1] / secs:.0f}; {host_load}",
                    flush=True,
                )
                print(f"  writers' backends: {writers.state_shares()}", flush=True)
                if args.statements:
                    for c in (prov, sub):
                        print_statements(c, pair.name, txns)
                for kind, v in sorted(writers.split().items()):
                    print(f"  {kind}: {1e6 * v / txns:.0f} µs a transaction", flush=True)
            finally:
                s.teardown(pair)
                pair.drop()
    finally:
        for c in (prov, sub):
            c.destroy()
        if not args.keep_logs:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    return 0


def wal_lsn(c: rb.LocalCluster) -> int:
    """The provider's WAL insert position, in bytes."""
    with psycopg.connect(c.connstr("postgres"), autocommit=True) as conn:
        return int(conn.execute("select pg_current_wal_insert_lsn() - '0/0'").fetchone()[0])


def wal_syncs(c: rb.LocalCluster) -> int:
    """How many times the cluster flushed its WAL to disk so far (pg_stat_wal)."""
    with psycopg.connect(c.connstr("postgres"), autocommit=True) as conn:
        return int(conn.execute("select wal_sync from pg_stat_wal").fetchone()[0])


def print_statements(c: rb.LocalCluster, dbname: str, txns: float, top: int = 40) -> None:
    """The statements that took most of the server's time (nested ones too), per transaction."""
    with psycopg.connect(c.connstr(dbname), autocommit=True) as conn:
        rows = conn.execute(
            "select total_exec_time + total_plan_time, calls, plans, toplevel,"
            " regexp_replace(left(query, 110), '\\s+', ' ', 'g')"
            " from pg_stat_statements where query not like '%%pg_stat_%%'"
            " order by 1 desc limit %s",
            (top,),
        ).fetchall()
    print(f"  {c.name}, statements by time (µs a transaction; calls; plans; top level):")
    for ms, calls, plans, toplevel, query in rows:
        print(f"    {1000 * ms / txns:7.0f}  {calls:8d} {plans:6d} {'T' if toplevel else ' '}  {query}")


def lag_or_tps(s: rb.System, pair: rb.Pair, args: argparse.Namespace) -> dict:
    """W2b's heartbeat lag at the rate, or (flat out) pgbench's tps alone."""
    if args.rate and not args.tpcb and not isinstance(s, rb.NoReplication):
        return rb.lag_run(s, pair, args.seconds, args.rate)
    extra = ([] if args.tpcb else ["-N"]) + (["-R", str(args.rate)] if args.rate else [])
    tps = rb.pgbench_run(pair.env.prov, pair.name, *extra, "-c2", "-j2", f"-T{args.seconds}")
    return {"tps": tps}


if __name__ == "__main__":
    sys.exit(main())
