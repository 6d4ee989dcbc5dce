"""Cascade benchmark: lag per level, switchover and failover; pgcascade and Londiste 3 in one run.

Four throwaway clusters on loopback (fsync and synchronous_commit on, wal_level=logical): a root,
two branches fed by the root, and a leaf fed by branch 1.  pgbench tables at scale 10 with a
primary key on pgbench_history, plus a heartbeat table; every node holds every table.

    lag per level   pgbench -N -R 500 on the root; a heartbeat row updated every 50 ms on the root,
                    polled every 10 ms on branch 1 (one level down) and on the leaf (two levels):
                    median and p95 of the time until each update is visible there.
    switchover      pgbench -R 300 on the root and a writer committing one small UPDATE every 5 ms
                    to whichever node takes writes; `takeover ROOT` on branch 1.  Figures: the
                    longest time no write could commit anywhere ("writes blocked"), and the
                    command's own duration.  Londiste 3's `takeover` in the same run, with its own
                    databases on the same clusters and the same writer, which (as Londiste does not
                    refuse writes on a branch) writes only to the node pgq_node calls the root.
    failover        branch 2 and then the leaf are moved under the new root (branch 1); its cluster
                    is stopped with -m immediate under load; `takeover branch1 --dead-root` on the
                    old root (a branch of branch 1 by then): the time from the command's start until
                    it returned with every survivor following the new root, and until the writer
                    committed there.

Goals (issue 4): writes blocked under 2 s in a switchover, failover done under 10 s, under 50 ms
added lag per level.  Usage: python bench/cascade_bench.py [--seconds 20] [--no-londiste]
Results go to stdout; bench/results/cascade.md records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import itertools

from replication_bench import (
    LONDISTE,
    PGBENCH,
    PGQD,
    PROCS,
    log,
    percentile,
    run,
)

from pgcascade.dev.localcluster import new_cluster, pg_bindir

PGCASCADE = [sys.executable, "-m", "pgcascade"]
QUEUE = "cbench"
NODES = ("root", "branch1", "branch2", "leaf")
PROVIDER = {"branch1": "root", "branch2": "root", "leaf": "branch1"}
TABLES = ["pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history", "heartbeat"]


class Writer(threading.Thread):
    """Commits one small UPDATE every 5 ms on the first node of `targets` that takes it."""

    def __init__(self, targets: dict[str, str], is_root_sql: str | None = None):
        super().__init__(daemon=True)
        self.targets = targets
        # for a system that does not refuse writes on a node that is not the root: the writer,
        # like an application that follows the root, writes only where this query says true
        self.is_root_sql = is_root_sql
        self.stop = threading.Event()
        self.commits: list[tuple[float, str]] = []

    def run(self) -> None:
        conns: dict[str, psycopg.Connection] = {}
        while not self.stop.is_set():
            for name, dsn in list(self.targets.items()):
                try:
                    if name not in conns or conns[name].closed:
                        conns[name] = psycopg.connect(dsn, autocommit=True, connect_timeout=2)
                    if self.is_root_sql and not conns[name].execute(self.is_root_sql).fetchone()[0]:
                        continue
                    conns[name].execute("update pgbench_branches set bbalance = bbalance + 1 where bid = 1")
                    self.commits.append((time.monotonic(), name))
                    break
                except psycopg.Error:
                    with contextlib.suppress(Exception):
                        conns.pop(name).close()
            time.sleep(0.005)
        for c in conns.values():
            c.close()

    def longest_gap(self, since: float) -> float:
        times = [t for t, _ in self.commits if t >= since]
        return max((b - a for a, b in itertools.pairwise(times)), default=float("nan"))

    def first_commit_on(self, name: str, since: float) -> float | None:
        return next((t for t, n in self.commits if n == name and t >= since), None)


def pgbench(dsn: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([PGBENCH, "-n", *args, dsn], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def init_schema(root_dsn: str, others: list[str]) -> None:
    run([PGBENCH, "-i", "-q", "-s", "10", "-n", root_dsn])
    with psycopg.connect(root_dsn, autocommit=True) as c:
        c.execute("alter table pgbench_history add column hid bigserial primary key")
        c.execute("create table heartbeat (id int primary key, t timestamptz)")
        c.execute("insert into heartbeat values (1, now())")
    dump = run([str(pg_bindir() / "pg_dump"), "-s", "--no-owner", "-x", root_dsn]).stdout
    dump = "\n".join(line for line in dump.splitlines() if not line.startswith("\\"))
    for dsn in others:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(dump)


def lag_per_level(root: str, levels: dict[str, str], seconds: int) -> dict[str, dict]:
    """Heartbeat lag on each node of `levels` while pgbench -N -R 500 runs on the root."""
    stop = threading.Event()
    sent: list[tuple[datetime.datetime, float]] = []
    seen: dict[str, list[tuple[datetime.datetime, float]]] = {n: [] for n in levels}

    def beat() -> None:
        with psycopg.connect(root, autocommit=True) as c:
            nxt = time.monotonic()
            while not stop.is_set():
                v = datetime.datetime.now(datetime.UTC)
                c.execute("update heartbeat set t = %s where id = 1", (v,))
                sent.append((v, time.monotonic()))
                nxt += 0.05
                time.sleep(max(0.0, nxt - time.monotonic()))

    def poll(name: str, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            last = None
            deadline = None
            while deadline is None or time.monotonic() < deadline:
                v = c.execute("select t from heartbeat where id = 1").fetchone()[0]
                if v != last:
                    seen[name].append((v, time.monotonic()))
                    last = v
                if stop.is_set():
                    deadline = deadline or time.monotonic() + 10
                    if sent and last is not None and last >= sent[-1][0]:
                        return
                time.sleep(0.01)

    load = pgbench(root, "-N", "-R", "500", "-c", "2", "-j", "2", "-T", str(seconds + 2))
    time.sleep(1)
    threads = [threading.Thread(target=beat)] + [
        threading.Thread(target=poll, args=kv) for kv in levels.items()
    ]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    load.wait(timeout=60)
    out = {}
    for name, obs in seen.items():
        lags, j = [], 0
        for v, committed in sent:
            while j < len(obs) and obs[j][0] < v:
                j += 1
            if j < len(obs):
                lags.append(max(0.0, obs[j][1] - committed))
        out[name] = {"median": statistics.median(lags), "p95": percentile(lags, 0.95), "n": len(lags)}
    return out


class Pgcascade:
    def __init__(self, work: Path, dsns: dict[str, str]):
        self.work, self.dsns = work, dsns
        self.workers: dict[str, subprocess.Popen] = {}

    def ini(self, name: str) -> Path:
        p = self.work / f"pgc_{name}.ini"
        p.write_text(
            f"[pgcascade]\njob_name = pgc_{name}\ndb = {self.dsns[name]}\nqueue_name = {QUEUE}\n"
            f"logfile = {self.work}/pgc_{name}.log\npidfile = {self.work}/pgc_{name}.pid\n"
            "loop_delay = 0.5\n"
        )
        return p

    def cli(self, name: str, *args: str, timeout: float = 600) -> str:
        return run([*PGCASCADE, str(self.ini(name)), *args], timeout=timeout).stdout

    def setup(self) -> None:
        self.cli("root", "create-root", "root")
        self.cli("root", "add-table", *TABLES)
        self.cli("root", "add-seq", "--all")
        for n, p in PROVIDER.items():
            self.cli(n, f"create-{'leaf' if n == 'leaf' else 'branch'}", n, "--provider", self.dsns[p])
            self.cli(n, "add-table", "--all")
            self.cli(n, "add-seq", "--all")
        for n in NODES:
            if n != "leaf":
                ticker = self.work / f"pgc_ticker_{n}.ini"
                ticker.write_text(
                    f"[pgcascade]\njob_name = pgc_ticker_{n}\ndb = {self.dsns[n]}\nticker_period = 0.01\n"
                    f"maint_period = 1\nlogfile = {self.work}/pgc_ticker_{n}.log\n"
                    f"pidfile = {self.work}/pgc_ticker_{n}.pid\n"
                )
                PROCS.start([*PGCASCADE, "ticker", str(ticker)], self.work / f"pgc_ticker_{n}.out")
            self.workers[n] = PROCS.start(
                [*PGCASCADE, str(self.ini(n)), "worker"], self.work / f"pgc_{n}.out"
            )
        self.cli("branch1", "wait-sync")
        self.cli("branch2", "wait-sync")
        self.cli("leaf", "wait-sync")

    def switchover(self, writer: Writer) -> dict:
        started = time.monotonic()
        out = self.cli("branch1", "takeover", "root", "--timeout", "60")
        took = time.monotonic() - started
        log(f"pgcascade takeover: {out.strip()}")
        reported = float(out.split("writes were refused for ")[1].split("s")[0])
        return {"command": took, "reported_refused": reported}


class Londiste:
    def __init__(self, work: Path, dsns: dict[str, str], clusters: dict):
        self.work, self.dsns, self.clusters = work, dsns, clusters
        self.dir = work / "londiste"
        self.dir.mkdir(exist_ok=True)

    def ini(self, name: str) -> Path:
        p = self.dir / f"{name}.ini"
        p.write_text(
            f"[londiste]\njob_name = ld_{name}\ndb = {self.dsns[name]}\nqueue_name = {QUEUE}\n"
            f"logfile = {self.dir}/{name}.log\npidfile = {self.dir}/{name}.pid\nloop_delay = 0.1\n"
        )
        return p

    def cli(self, name: str, *args: str, timeout: float = 600) -> str:
        return run([*LONDISTE, str(self.ini(name)), *args], timeout=timeout).stdout

    def setup(self) -> None:
        for n in NODES:
            with psycopg.connect(self.dsns[n], autocommit=True) as c:
                for ext in ("pgq", "pgq_node", "londiste"):
                    c.execute(f"create extension if not exists {ext}")
        self.cli("root", "create-root", "root", self.dsns["root"])
        for n, p in PROVIDER.items():
            kind = "leaf" if n == "leaf" else "branch"
            self.cli(n, f"create-{kind}", n, self.dsns[n], f"--provider={self.dsns[p]}")
        self.cli("root", "add-table", *TABLES)
        for n in PROVIDER:
            self.cli(n, "add-table", *TABLES, "--expect-sync")  # the rows are there already (same dump)
        for n in NODES:
            c = self.clusters[n]
            ini = self.dir / f"pgqd_{n}.ini"
            ini.write_text(
                f"[pgqd]\nbase_connstr = host=127.0.0.1 port={c.port} user=postgres\n"
                f"initial_database = postgres\ndatabase_list = ld\nlogfile = {self.dir}/pgqd_{n}.log\n"
                f"pidfile = {self.dir}/pgqd_{n}.pid\nticker_period = 1\n"
            )
            PROCS.start([PGQD, str(ini)], self.dir / f"pgqd_{n}.out")
            PROCS.start([*LONDISTE, str(self.ini(n)), "worker"], self.dir / f"{n}.out")
        time.sleep(5)

    def switchover(self) -> dict:
        writer = Writer(
            {"root": self.dsns["root"], "branch1": self.dsns["branch1"]},
            is_root_sql=f"select node_type = 'root' from pgq_node.get_node_info('{QUEUE}')",
        )
        writer.start()
        time.sleep(1)
        started = time.monotonic()
        out = run([*LONDISTE, str(self.ini("branch1")), "takeover", "root"], timeout=600)
        took = time.monotonic() - started
        time.sleep(2)
        writer.stop.set()
        writer.join()
        log(f"londiste takeover: rc {out.returncode} {out.stderr.strip()[-400:]}")
        return {"command": took, "writes_blocked": writer.longest_gap(started - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=20, help="length of the lag measurement")
    ap.add_argument("--no-londiste", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgcascade-cascade-bench-"))
    log(f"work directory {work}")
    clusters = {
        n: new_cluster(n, basedir=work / "clusters", settings={"shared_buffers": "256MB"}, fast_unsafe=False)
        for n in NODES
    }
    results: dict[str, object] = {}
    try:
        dsns = {n: c.create_database("pgc") for n, c in clusters.items()}
        init_schema(dsns["root"], [dsns[n] for n in PROVIDER])
        pgc = Pgcascade(work, dsns)
        log("pgcascade: setting up root, branch1, branch2, leaf (under branch1)")
        pgc.setup()
        log(f"lag per level for {args.seconds}s")
        results["lag"] = lag_per_level(
            dsns["root"], {"branch1": dsns["branch1"], "leaf": dsns["leaf"]}, args.seconds
        )
        log(f"lag: {results['lag']}")
        log("switchover under load")
        writer = Writer({"root": dsns["root"], "branch1": dsns["branch1"]})
        writer.start()
        load = pgbench(dsns["root"], "-R", "300", "-c", "2", "-j", "2", "-T", "60")
        time.sleep(3)
        t0 = time.monotonic()
        results["switchover"] = pgc.switchover(writer)
        time.sleep(2)
        results["switchover"]["writes_blocked"] = writer.longest_gap(t0 - 1)
        writer.stop.set()
        writer.join()
        load.terminate()
        load.wait()
        log(f"switchover: {results['switchover']}")
        # failover: branch1 is the root now, the old root its branch; branch2 moves under branch1
        # and the leaf under branch2, so that losing branch1 leaves two orphans, one of them
        # perhaps ahead of the node that takes over
        for n in NODES:
            pgc.cli(n, "wait-root", "--timeout", "120")
        pgc.cli("leaf", "change-provider", "--provider", "branch2")
        pgc.cli("branch2", "change-provider", "--provider", "branch1")
        writer = Writer({"branch1": dsns["branch1"], "root": dsns["root"]})
        writer.start()
        load = pgbench(dsns["branch1"], "-R", "300", "-c", "2", "-j", "2", "-T", "60")
        time.sleep(3)
        clusters["branch1"].stop("immediate")
        t0 = time.monotonic()
        out = pgc.cli("root", "takeover", "branch1", "--dead-root", "--timeout", "60")
        done = time.monotonic()
        log(f"failover: {out.strip()}")
        time.sleep(1)
        first = writer.first_commit_on("root", t0)
        writer.stop.set()
        writer.join()
        load.wait(timeout=60)
        followers = {}
        for n in ("branch2", "leaf"):
            with psycopg.connect(dsns[n]) as c:
                followers[n] = c.execute("select provider_node from pgcascade.node").fetchone()[0]
        results["failover"] = {
            "command": done - t0,
            "first_write_on_new_root": (first - t0) if first else None,
            "followers": followers,
        }
        log(f"failover: {results['failover']}")
        if not args.no_londiste:
            clusters["branch1"].start()
            ld_dsns = {n: c.create_database("ld") for n, c in clusters.items()}
            init_schema(ld_dsns["root"], [ld_dsns[n] for n in PROVIDER])
            for n in PROVIDER:  # the same rows everywhere, as Londiste's --expect-sync assumes
                run(
                    [
                        "bash",
                        "-c",
                        f"{pg_bindir()}/pg_dump -a '{ld_dsns['root']}' | {pg_bindir()}/psql -q '{ld_dsns[n]}'",
                    ]
                )
            ld = Londiste(work, ld_dsns, clusters)
            log("londiste: setting up root, branch1, branch2, leaf")
            ld.setup()
            load = pgbench(ld_dsns["root"], "-R", "300", "-c", "2", "-j", "2", "-T", "60")
            time.sleep(3)
            results["londiste_switchover"] = ld.switchover()
            load.terminate()
            load.wait()
            log(f"londiste switchover: {results['londiste_switchover']}")
    finally:
        PROCS.close()
        for c in clusters.values():
            c.destroy()
    print(report(results))


def report(r: dict) -> str:
    lag, sw, fo = r["lag"], r["switchover"], r["failover"]
    ld = r.get("londiste_switchover")
    l1, l2 = lag["branch1"]["median"] * 1000, lag["leaf"]["median"] * 1000
    rows = [
        "| figure | pgcascade | Londiste 3 | ratio | goal | met |",
        "|---|---:|---:|---:|---|---|",
        f"| lag, one level down (branch 1): median / p95 | {l1:.1f} / {lag['branch1']['p95'] * 1000:.1f} ms | | | | |",
        f"| lag, two levels down (leaf under branch 1): median / p95 | {l2:.1f} / {lag['leaf']['p95'] * 1000:.1f} ms | | | | |",
        f"| lag added by the second level (median) | {l2 - l1:.1f} ms | | | < 50 ms | {'yes' if l2 - l1 < 50 else 'no'} |",
        f"| switchover: writes blocked (longest gap between commits) | {sw['writes_blocked']:.2f} s"
        f" | {ld['writes_blocked']:.2f} s | {ld['writes_blocked'] / sw['writes_blocked']:.1f} |"
        f" < 2 s | {'yes' if sw['writes_blocked'] < 2 else 'no'} |"
        if ld
        else f"| switchover: writes blocked | {sw['writes_blocked']:.2f} s | - | | < 2 s | {'yes' if sw['writes_blocked'] < 2 else 'no'} |",
        f"| switchover: takeover command | {sw['command']:.2f} s | {ld['command']:.2f} s |"
        f" {ld['command'] / sw['command']:.1f} | | |"
        if ld
        else f"| switchover: takeover command | {sw['command']:.2f} s | - | | | |",
        f"| failover: takeover --dead-root until every survivor follows | {fo['command']:.2f} s | | | < 10 s |"
        f" {'yes' if fo['command'] < 10 else 'no'} |",
        f"| failover: first write committed on the new root after the command started |"
        f" {fo['first_write_on_new_root'] or float('nan'):.2f} s | | | | |",
    ]
    return "\n".join(rows) + f"\n\nfollowers after failover: {fo['followers']}\n"


if __name__ == "__main__":
    main()
