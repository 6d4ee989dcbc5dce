#!/usr/bin/env python3
"""Where two masters' CPU goes: per process role, per transaction, at a fixed write rate.

A diagnostic beside bench/two_way_bench.py, for comparing designs on a shared machine: CPU time
per transaction and statements per batch move far less with the load of others than wall time.
Two throwaway clusters set up as the two-way bench sets up pgcascade (the same classes), with
pg_stat_statements preloaded; the bench's pgbench script runs at --rate tps on both masters for
--seconds.  Over the middle of that window it reads `/proc/PID/stat` of every process involved:
the writers' backends, pgbench, each daemon (worker, ticker, capture) and its backends (named by
application_name), the servers' background processes; and per master the batches its worker
logged.  It prints CPU ms per second and microseconds per transaction by role, and the
statements of master a that took the most time (pg_stat_statements, nested ones included).

    .venv/bin/python bench/two_way_cpu.py [--rate 200] [--seconds 20] [--logical] [--top 25]
                                          [--profile]

`--profile` runs the workers under cProfile with a CPU-time clock and prints their top functions.
"""

from __future__ import annotations

import argparse
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from replication_bench import PGBENCH, PGCASCADE, PROCS, clone, log, make_template, pgbench_args
from two_way_bench import NAMES, SCRIPT, Masters, PgCascade, PgCascadeLogical, PgLogical, System
from worker_cpu import PROFILER

from pgcascade.dev.localcluster import LocalCluster, new_cluster, wait_until

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def children(ppid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def postmaster_pid(c: LocalCluster) -> int:
    return int((c.datadir / "postmaster.pid").read_text().split()[0])


def server_roles(c: LocalCluster, master: str) -> dict[int, str]:
    """Every process of the cluster, by role: backends by application_name, the rest by type."""
    roles = {pid: f"{master}: server, other" for pid in children(postmaster_pid(c))}
    with c.connect() as conn:
        for pid, app, btype, dbname in conn.execute(
            "select pid, application_name, backend_type, datname from pg_stat_activity"
        ).fetchall():
            if btype != "client backend":
                roles[pid] = f"{master}: server, {btype}"
            elif app == "pgbench":
                roles[pid] = f"{master}: writers' backends"
            elif app.startswith("pgcascade") or app.startswith("pgc:"):
                roles[pid] = f"{master}: backend of {app.removeprefix('pgc:')}"
            elif dbname and dbname.startswith("pgcascade"):
                roles[pid] = f"{master}: backend of {app or 'unnamed'}"
    return roles


class Profiled(PgCascade):
    """pgcascade as the bench sets it up, with each daemon's connections named by its job."""

    def __init__(self, base: type[PgCascade], profile: Path | None) -> None:
        super().__init__()
        self.base = base
        self.create_args = base.create_args
        self.key = base.key
        self.profile = profile

    def root_created(self, d: Path, ini: Path, name: str) -> None:
        self.base.root_created(self, d, ini, name)  # type: ignore[arg-type]

    def setup(self, m: Masters) -> None:
        start = PROCS.start

        def named(cmd: list[str], logfile: Path) -> subprocess.Popen:
            role = logfile.stem.replace("_", " ")
            os.environ["PGAPPNAME"] = f"pgc:{role}"
            if self.profile is not None and role.startswith("worker"):
                prof = self.profile / f"{role.replace(' ', '_')}.prof"
                cmd = [sys.executable, "-c", PROFILER, str(prof), *cmd[len(PGCASCADE) :]]
            p = start(cmd, logfile)
            self.roles[p.pid] = role
            return p

        self.roles: dict[int, str] = {}
        PROCS.start = named  # type: ignore[method-assign]
        try:
            super().setup(m)
        finally:
            PROCS.start = start  # type: ignore[method-assign]
            os.environ.pop("PGAPPNAME", None)


def sample(procs: dict[int, str]) -> dict[int, float]:
    return {pid: s for pid in procs if (s := cpu_seconds(pid)) is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=200, help="tps per master")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--hot", type=int, default=10000)
    ap.add_argument(
        "--system", default="pgcascade", choices=["pgcascade", "pgcascade_logical", "pglogical", "none"]
    )
    ap.add_argument("--top", type=int, default=25, help="statements of master a to list")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pgcascade-twowaycpu-"))
    os.chmod(base, 0o777)
    settings = {
        "shared_preload_libraries": "'pg_stat_statements,pglogical'",
        "pg_stat_statements.track": "all",
        "shared_buffers": "256MB",
    }
    clusters = (
        new_cluster("a", basedir=base, fast_unsafe=False, settings=settings),
        new_cluster("b", basedir=base, fast_unsafe=False, settings=settings),
    )
    work = base / "work"
    work.mkdir()
    prof_dir = work if args.profile else None
    system: System = (
        Profiled(PgCascadeLogical if args.system == "pgcascade_logical" else PgCascade, prof_dir)
        if args.system.startswith("pgcascade")
        else PgLogical()
        if args.system == "pglogical"
        else System()
    )
    m = Masters(clusters, "pgcascade_cpu", work)
    try:
        for c in clusters:
            make_template(c, "tpl", 10)
            with c.connect("tpl") as conn:
                conn.execute("insert into heartbeat values (2, now())")
            clone(c, "tpl", m.dbname)
            with c.connect() as conn:
                conn.execute("create extension if not exists pg_stat_statements")
        log("set-up")
        system.setup(m)
        for c in (
            clusters if isinstance(system, Profiled) else ()
        ):  # every daemon connected (they start slowly on a busy machine)
            wait_until(
                lambda c=c: daemons_connected(c, system.key == "pgcascade_logical"),
                timeout=300,
                what="the daemons",
            )
        script = work / "two_way.sql"
        script.write_text(SCRIPT.format(hot=args.hot))
        benches = [
            subprocess.Popen(
                [PGBENCH, "-n", "-f", str(script), "-c2", "-j2", f"-T{args.seconds}"]
                + (["-R", str(args.rate)] if args.rate else [])
                + pgbench_args(c, m.dbname),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in clusters
        ]
        time.sleep(min(3, args.seconds / 4))
        roles: dict[int, str] = {}
        for i, c in enumerate(clusters):
            roles.update(server_roles(c, NAMES[i]))
        for i, b in enumerate(benches):
            roles[b.pid] = f"{NAMES[i]}: pgbench"
        for pid, role in getattr(system, "roles", {}).items():
            roles[pid] = f"{role[-1]}: {role[:-2]} (Python)"
        with clusters[0].connect() as conn:
            conn.execute("select pg_stat_statements_reset()")
        logs = {n: work / (system.key or "none") / f"{n}.log" for n in NAMES}
        batches0 = {n: logged_batches(p) for n, p in logs.items()}
        counts0 = [history_rows(c, m.dbname) for c in clusters]
        t0, cpu0 = time.monotonic(), sample(roles)
        for pid, role in sorted(roles.items(), key=lambda kv: kv[1]):
            log(f"{pid}: {role}")
        window = max(1.0, args.seconds - 2 * min(3, args.seconds / 4))
        stopper = threading.Event()
        stopper.wait(window)
        t1, cpu1 = time.monotonic(), sample(roles)
        counts1 = [history_rows(c, m.dbname) for c in clusters]
        batches = {n: logged_batches(p) - batches0[n] for n, p in logs.items()}
        with clusters[0].connect() as conn:
            top = conn.execute(
                "select calls, total_exec_time + total_plan_time, rows, left(regexp_replace(query, '\\s+', ' ', 'g'), 150)"
                " from pg_stat_statements order by 2 desc limit %s",
                (args.top,),
            ).fetchall()
        for b in benches:
            b.communicate(timeout=args.seconds + 120)
    finally:
        system.teardown(m)
        PROCS.close()
        for c in clusters:
            c.destroy()  # about 1 GB a run; the logs and profiles under base go at the end
    elapsed = t1 - t0
    # transactions written on both masters in the window: a history row each
    txns = sum(c1 - c0 for c0, c1 in zip(counts0, counts1, strict=True))
    by_role: dict[str, float] = defaultdict(float)
    for pid, role in roles.items():
        if pid in cpu0 and pid in cpu1:
            by_role[role] += cpu1[pid] - cpu0[pid]
    total = sum(by_role.values())
    print(
        f"\n{args.system}, {args.rate or 'unthrottled'} tps per master:"
        f" {txns / elapsed:.0f} tps in all over {elapsed:.1f} s; batches a {batches['a']}, b {batches['b']}"
        f" ({sum(batches.values()) / elapsed:.0f}/s)"
    )
    print(f"{'role':<48} {'CPU ms/s':>9} {'us/txn':>8}")
    for role, s in sorted(by_role.items(), key=lambda kv: -kv[1]):
        if s > 0:
            print(f"{role:<48} {s / elapsed * 1000:9.1f} {s / max(txns, 1) * 1e6:8.1f}")
    print(f"{'total':<48} {total / elapsed * 1000:9.1f} {total / max(txns, 1) * 1e6:8.1f}")
    nb = max(sum(batches.values()), 1)
    print(f"\nmaster a, top statements by time (ms per batch of both workers: {nb} batches):")
    for calls, ms, rows, query in top:
        print(f"{calls:8d} {ms:9.1f} ms {ms / nb:7.3f} ms/b {rows:9d} rows  {query}")
    if prof_dir is not None:
        for p in sorted(prof_dir.glob("*.prof")):
            print(f"\n{p.stem}:")
            pstats.Stats(str(p)).sort_stats("cumulative").print_stats(30)
    shutil.rmtree(base, ignore_errors=True)
    return 0


def daemons_connected(c: LocalCluster, logical: bool) -> bool:
    """The ticker, the worker (its own database, and its peer subscription's on both sides) and
    the capture daemon have their connections to this cluster.  (The worker names its sessions
    itself: PGAPPNAME does not reach them.)"""
    with c.connect() as conn:
        apps = [r[0] for r in conn.execute("select application_name from pg_stat_activity")]
    return (
        any(a.startswith("pgcascade ticker") for a in apps)
        and sum(a.startswith("pgcascade worker") for a in apps) >= 2
        and (not logical or any(a.startswith("pgcascade capture") for a in apps))
    )


def logged_batches(path: Path) -> int:
    return path.read_text().count("{count:") if path.exists() else 0


def history_rows(c: LocalCluster, db: str) -> int:
    """The master's own history rows: those of its share of the spread sequence."""
    with c.connect(db) as conn:
        return conn.execute(
            "select count(*) from pgbench_history, pg_sequences s where s.sequencename = 'pgbench_history_hid_seq'"
            " and (s.increment_by = 1 or hid % s.increment_by = s.last_value % s.increment_by)"
        ).fetchone()[0]


if __name__ == "__main__":
    sys.exit(main())
