#!/usr/bin/env python3
"""Two-way benchmark: pgcascade masters beside pglogical 2, the same workload, one run.

Two fresh clusters A and B on loopback (fsync and synchronous_commit on, shared_buffers 1GB,
track_commit_timestamp on, pglogical preloaded on both for both systems).  Each system works in
databases of its own on both (kept until the clusters go: pglogical's supervisor never lets a
DROP DATABASE finish on PostgreSQL 15), cloned from one pgbench template (scale 10, `pgbench_history`
given `hid bigserial primary key`, a heartbeat table with a row per master), so both masters
start equal.  Each system is set up as its users would:

  pgcascade   create-root on each master (queues tw_a, tw_b), add-table of the five tables,
              add-peer both ways (last-update-wins), add-seq pgbench_history_hid_seq (spread:
              every 10th value per master); a ticker and a worker per master, every setting at
              its shipped default (the same configuration for every figure).
              `pgcascade_logical`: the same with `create-root --capture=logical` and a
              capture daemon per master.
  pglogical   pglogical 2 (Debian postgresql-15-pglogical): a node per master, the five tables
              in the default set, a subscription each way with forward_origins = '{}' and no
              initial copy, pglogical.conflict_resolution = last_update_wins; the history
              sequence spread by hand the same way (increment 10, a residue per master).

Workload, on both masters at once for --seconds: a pgbench script of pgbench's -N shape
(update an account, read it, insert a history row) whose account ids come from the first --hot
ids, so the two masters update the same accounts and conflicts happen; each master's history
keys come from its share of the sequence.  Two runs per system: unthrottled (-c2 -j2 per master:
throughput per master), then at --rate tps per master (lag each way).  During both, a heartbeat
row per master is updated every 50 ms and polled on the other master every 10 ms: lag each
way is from the update's commit until the other master shows it (median, p95).  After the
writers stop, each master writes a last heartbeat; time to converge is until each master
shows the other's, and then every table is compared on both (md5 of all rows, by key):
`equal` must be yes.  Conflicts: pgcascade's conflict log on both masters; pglogical's
CONFLICT lines in both servers' logs (conflict_log_level = log).  The report ends with the goals
of issue 25 for each pgcascade variant: throughput of both masters flat out >= 0.9x pglogical's,
lag median at --rate (the slower direction) <= 2x pglogical's, every table equal after every run.

Bucardo (Debian `bucardo`) is not measured: it needs a daemon of its own with a control
database, Perl DBI drivers and a superuser plperlu install, which do not fit this run.

    bash bench/install-peers.sh              # once, as root: also postgresql-15-pglogical
    .venv/bin/python bench/two_way_bench.py [--seconds 30] [--hot 10000] [--rate 200]
                                            [--only pgcascade,pgcascade_logical,pglogical]
                                            [--report FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
from replication_bench import (
    PGBENCH,
    PGCASCADE,
    PROCS,
    ROOT,
    checkpoint,
    clone,
    log,
    make_template,
    percentile,
    pgbench_args,
    run,
    source_info,
)

from pgcascade.dev.localcluster import LocalCluster, new_cluster

TABLES = ["pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history", "heartbeat"]
KEYS = {
    "pgbench_accounts": "aid",
    "pgbench_branches": "bid",
    "pgbench_tellers": "tid",
    "pgbench_history": "hid",
    "heartbeat": "id",
}
HISTORY_SEQ = "pgbench_history_hid_seq"
STEP = 10  # the history sequence: every 10th value per master (as pgcascade's add-seq)
NAMES = ("a", "b")
SCRIPT = """\\set aid random(1, {hot})
\\set bid random(1, 10)
\\set tid random(1, 100)
\\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
"""


@dataclass
class Masters:
    """The two databases of one system, one per cluster."""

    clusters: tuple[LocalCluster, LocalCluster]
    dbname: str
    work: Path

    def dsn(self, i: int) -> str:
        return self.clusters[i].connstr(self.dbname)

    def conn(self, i: int) -> psycopg.Connection:
        return psycopg.connect(self.dsn(i), autocommit=True)


class System:
    label = ""
    key = ""

    def setup(self, m: Masters) -> None: ...

    def teardown(self, m: Masters) -> None: ...

    def conflicts(self, m: Masters) -> int:
        raise NotImplementedError

    def notes(self) -> str:
        return ""


class PgCascade(System):
    label = "pgcascade"
    key = "pgcascade"
    create_args: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.daemons: list[subprocess.Popen] = []

    def setup(self, m: Masters) -> None:
        d = m.work / self.key
        d.mkdir(parents=True, exist_ok=True)
        inis = []
        for i, name in enumerate(NAMES):
            ini = d / f"{name}.ini"
            ini.write_text(
                f"[pgcascade]\njob_name = {name}\ndb = {m.dsn(i)}\nqueue_name = tw_{name}\n"
                f"logfile = {d}/{name}.log\npidfile = {d}/{name}.pid\n"
            )
            inis.append(ini)
            cli(ini, "create-root", name, *self.create_args)
            self.root_created(d, ini, name)
            cli(ini, "add-table", *TABLES)
        for i in range(2):
            other = 1 - i
            cli(inis[i], "add-peer", NAMES[other], "--location", m.dsn(other))
        for ini in inis:
            cli(ini, "add-seq", HISTORY_SEQ)
        for i, name in enumerate(NAMES):
            tini = d / f"ticker_{name}.ini"
            tini.write_text(
                f"[pgcascade]\njob_name = ticker_{name}\ndb = {m.dsn(i)}\n"
                f"logfile = {d}/ticker_{name}.log\npidfile = {d}/ticker_{name}.pid\n"
            )
            self.daemons.append(PROCS.start([*PGCASCADE, "ticker", str(tini)], d / f"ticker_{name}.out"))
            self.daemons.append(PROCS.start([*PGCASCADE, str(inis[i]), "worker"], d / f"worker_{name}.out"))

    def root_created(self, d: Path, ini: Path, name: str) -> None:
        pass

    def teardown(self, m: Masters) -> None:
        for p in self.daemons:
            PROCS.stop(p)
        self.daemons = []

    def conflicts(self, m: Masters) -> int:
        total = 0
        for i in range(2):
            with m.conn(i) as conn:
                total += conn.execute("select count(*) from pgcascade.conflict").fetchone()[0]
        return total

    def notes(self) -> str:
        return "pgcascade: trigger capture, every setting at its shipped default (ticker, queue, worker), last-update-wins."


class PgCascadeLogical(PgCascade):
    """The masters capture logically: a slot per master read by its capture daemon."""

    label = "pgcascade, logical capture"
    key = "pgcascade_logical"
    create_args = ("--capture=logical",)

    def root_created(self, d: Path, ini: Path, name: str) -> None:
        cap = d / f"{name}_capture.ini"
        cap.write_text(
            ini.read_text()
            .replace(f"job_name = {name}", f"job_name = {name}_capture")
            .replace(f"{name}.pid", f"{name}_capture.pid")
        )
        self.daemons.append(PROCS.start([*PGCASCADE, str(cap), "capture"], d / f"capture_{name}.out"))

    def notes(self) -> str:
        return "pgcascade, logical capture: the same, with `create-root --capture=logical` and a capture daemon per master."


class PgLogical(System):
    label = "pglogical 2"
    key = "pglogical"

    def __init__(self) -> None:
        self.log_offsets: list[int] = []

    def setup(self, m: Masters) -> None:
        for i, name in enumerate(NAMES):
            with m.conn(i) as conn:
                conn.execute("create extension pglogical")
                conn.execute("select pglogical.create_node(node_name := %s, dsn := %s)", (name, m.dsn(i)))
                conn.execute("select pglogical.replication_set_add_all_tables('default', array['public'])")
                spread_sequence(conn, residue=i + 1)
        self.log_offsets = [c.logfile.stat().st_size for c in m.clusters]
        for i, name in enumerate(NAMES):
            other = 1 - i
            with m.conn(i) as conn:
                conn.execute(
                    "select pglogical.create_subscription(subscription_name := %s, provider_dsn := %s,"
                    " replication_sets := array['default'], synchronize_structure := false,"
                    " synchronize_data := false, forward_origins := '{}')",
                    (f"{name}_from_{NAMES[other]}", m.dsn(other)),
                )
        for i in range(2):
            deadline = time.monotonic() + 60
            while True:
                with m.conn(i) as conn:
                    status = conn.execute(
                        "select status from pglogical.show_subscription_status()"
                    ).fetchone()
                if status and status[0] == "replicating":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pglogical subscription on {NAMES[i]}: {status}")
                time.sleep(0.2)

    def teardown(self, m: Masters) -> None:
        for i, name in enumerate(NAMES):
            with m.conn(i) as conn:
                conn.execute("select pglogical.drop_subscription(%s)", (f"{name}_from_{NAMES[1 - i]}",))

    def conflicts(self, m: Masters) -> int:
        total = 0
        for c, offset in zip(m.clusters, self.log_offsets, strict=True):
            with c.logfile.open("rb") as f:
                f.seek(offset)
                total += len(re.findall(rb"CONFLICT: remote", f.read()))
        return total

    def notes(self) -> str:
        return (
            "pglogical 2: conflict_resolution last_update_wins, conflict_log_level log (conflicts"
            " counted from the server logs), apply and walsender defaults."
        )


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        )
    return f"{os.cpu_count()} cores ({cpu}), PostgreSQL 15"


def cli(ini: Path, *args: str) -> str:
    return run([*PGCASCADE, str(ini), *args], timeout=300).stdout


def spread_sequence(conn: psycopg.Connection, residue: int) -> None:
    """pglogical has no such step: the same spread pgcascade's add-seq makes, by hand."""
    last = conn.execute(f"select last_value from {HISTORY_SEQ}").fetchone()[0]
    start = last + 1 + (residue - last - 1) % STEP
    conn.execute(f"alter sequence {HISTORY_SEQ} increment by {STEP}")
    conn.execute("select setval(%s, %s, false)", (HISTORY_SEQ, start))


def checksum(conn: psycopg.Connection, table: str) -> tuple:
    key = KEYS[table]
    return conn.execute(
        f"select count(*), md5(string_agg(t::text, ',' order by {key})) from {table} t"
    ).fetchone()


@dataclass
class RunFigures:
    tps: tuple[float, float]
    lag: dict[str, tuple[float, float]]  # "a->b": (median s, p95 s)
    converge: float
    equal: bool
    conflicts: int
    seconds: int


def workload(s: System, m: Masters, seconds: int, hot: int, rate: int | None) -> RunFigures:
    script = m.work / "two_way.sql"
    script.write_text(SCRIPT.format(hot=hot))
    stop = threading.Event()
    sent: dict[int, list[tuple[datetime.datetime, float]]] = {0: [], 1: []}
    seen: dict[int, list[tuple[datetime.datetime, float]]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def heartbeat(i: int) -> None:
        try:
            with m.conn(i) as conn:
                nxt = time.monotonic()
                while not stop.is_set():
                    v = datetime.datetime.now(datetime.UTC)
                    conn.execute("update heartbeat set t = %s where id = %s", (v, i + 1))
                    sent[i].append((v, time.monotonic()))
                    nxt += 0.05
                    time.sleep(max(0.0, nxt - time.monotonic()))
        except BaseException as e:
            errors.append(e)

    def poller(i: int) -> None:  # on the other master, the heartbeat of master i
        try:
            with m.conn(1 - i) as conn:
                last = None
                while not stop.is_set():
                    v = conn.execute("select t from heartbeat where id = %s", (i + 1,)).fetchone()[0]
                    if v != last:
                        seen[i].append((v, time.monotonic()))
                        last = v
                    time.sleep(0.01)
        except BaseException as e:
            errors.append(e)

    checkpoint(*m.clusters)
    conflicts_before = s.conflicts(m)
    throttle = ["-R", str(rate)] if rate else []
    benches = [
        subprocess.Popen(
            [
                PGBENCH,
                "-n",
                "-f",
                str(script),
                "-c2",
                "-j2",
                f"-T{seconds}",
                *throttle,
                *pgbench_args(c, m.dbname),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for c in m.clusters
    ]
    threads = [threading.Thread(target=f, args=(i,)) for f in (heartbeat, poller) for i in range(2)]
    for t in threads:
        t.start()
    outs = [b.communicate(timeout=seconds + 120) for b in benches]
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    tps = []
    for b, (out, err) in zip(benches, outs, strict=True):
        found = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
        if b.returncode != 0 or not found:
            raise RuntimeError(f"pgbench: exit {b.returncode}: {err[-2000:]}")
        tps.append(float(found.group(1)))
    # the writers stopped: a last heartbeat each; converged once each master shows the other's
    stopped = time.monotonic()
    last = datetime.datetime.now(datetime.UTC)
    for i in range(2):
        with m.conn(i) as conn:
            conn.execute("update heartbeat set t = %s where id = %s", (last, i + 1))
    deadline = stopped + 600
    while True:
        shown = []
        for i in range(2):
            with m.conn(1 - i) as conn:
                shown.append(conn.execute("select t from heartbeat where id = %s", (i + 1,)).fetchone()[0])
        if all(v >= last for v in shown):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{s.label}: the masters did not converge in 600 s")
        time.sleep(0.05)
    converge = time.monotonic() - stopped
    time.sleep(1)  # a conflict logged just after the apply's commit
    with m.conn(0) as ca, m.conn(1) as cb:
        equal = all(checksum(ca, t) == checksum(cb, t) for t in TABLES)
    lag = {}
    for i in range(2):
        lags = lag_values(sent[i], seen[i])
        # none arrived while polling (a loaded machine): longer than the run, shown as inf
        lag[f"{NAMES[i]}->{NAMES[1 - i]}"] = (
            (statistics.median(lags), percentile(lags, 0.95)) if lags else (math.inf, math.inf)
        )
    return RunFigures((tps[0], tps[1]), lag, converge, equal, s.conflicts(m) - conflicts_before, seconds)


def lag_values(
    sent: list[tuple[datetime.datetime, float]], seen: list[tuple[datetime.datetime, float]]
) -> list[float]:
    """Per heartbeat sent: from its commit until the other master showed it or a later one
    (heartbeats still in flight when the polling stopped are left out)."""
    lags, j = [], 0
    for v, committed in sent:
        while j < len(seen) and seen[j][0] < v:
            j += 1
        if j == len(seen):
            break
        lags.append(max(0.0, seen[j][1] - committed))
    return lags


def report(
    results: dict[str, dict[str, RunFigures]], systems: list[System], args, header: list[str]
) -> list[str]:
    lines = [*header, ""]
    for mode, title in (("max", "unthrottled (-c2 -j2 per master)"), ("rate", f"{args.rate} tps per master")):
        lines += [
            f"#### {title}, {args.seconds} s, account ids 1..{args.hot}",
            "",
            "| system | tps a | tps b | lag a→b median / p95 | lag b→a median / p95 | conflicts/s | converge after stop | equal |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for s in systems:
            f = results[s.key].get(mode)
            if f is None:
                continue
            lags = [f"{f.lag[k][0] * 1000:.0f} / {f.lag[k][1] * 1000:.0f} ms" for k in ("a->b", "b->a")]
            lines.append(
                f"| {s.label} | {f.tps[0]:.0f} | {f.tps[1]:.0f} | {lags[0]} | {lags[1]} |"
                f" {f.conflicts / f.seconds:.1f} | {f.converge:.2f} s | {'yes' if f.equal else 'NO'} |"
            )
        base = results.get("pglogical", {}).get(mode)
        for system in systems:
            ours = results[system.key].get(mode) if system.key.startswith("pgcascade") else None
            if base and ours:
                lines += [
                    "",
                    f"{system.label} / pglogical: throughput {sum(ours.tps) / sum(base.tps):.2f}x (both masters),"
                    f" lag a→b median {ours.lag['a->b'][0] / max(base.lag['a->b'][0], 1e-6):.2f}x,"
                    f" time to converge {ours.converge / max(base.converge, 1e-6):.2f}x.",
                ]
        lines.append("")
    lines += [f"- {s.notes()}" for s in systems]
    lines += ["", *goals(results, systems)]
    return lines


THROUGHPUT_GOAL = 0.9  # both masters flat out, share of pglogical's (issue 25)
LAG_GOAL = 2.0  # lag median at --rate, the slower direction, times pglogical's


def goals(results: dict[str, dict[str, RunFigures]], systems: list[System]) -> list[str]:
    """Issue 25's goals for each pgcascade variant against pglogical in this run."""
    base = results.get("pglogical", {})
    if not base.get("max") or not base.get("rate"):
        return ["Goals: not judged (pglogical was not measured in this run)."]
    lines = ["#### Goals (issue 25)", "", "| system | goal | measured | met |", "| --- | --- | --- | --- |"]
    for s in systems:
        ours = results.get(s.key, {})
        if not s.key.startswith("pgcascade") or not ours.get("max") or not ours.get("rate"):
            continue
        tput = sum(ours["max"].tps) / sum(base["max"].tps)
        lag = max(ours["rate"].lag[k][0] for k in ours["rate"].lag)
        base_lag = max(base["rate"].lag[k][0] for k in base["rate"].lag)
        equal = all(f.equal for f in ours.values())
        for goal, measured, met in (
            (
                f"throughput flat out >= {THROUGHPUT_GOAL}x pglogical",
                f"{tput:.2f}x ({sum(ours['max'].tps):.0f} vs {sum(base['max'].tps):.0f} tps)",
                tput >= THROUGHPUT_GOAL,
            ),
            (
                f"lag median <= {LAG_GOAL:g}x pglogical",
                f"{lag / max(base_lag, 1e-6):.2f}x ({lag * 1000:.0f} vs {base_lag * 1000:.0f} ms)",
                lag <= LAG_GOAL * base_lag,
            ),
            ("every table equal after each run", "yes" if equal else "NO", equal),
        ):
            lines.append(f"| {s.label} | {goal} | {measured} | {'met' if met else 'NOT met'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--hot", type=int, default=10000, help="account ids both masters update")
    ap.add_argument("--rate", type=int, default=200, help="tps per master of the throttled run")
    ap.add_argument("--only", default="pgcascade,pgcascade_logical,pglogical")
    ap.add_argument("--report", type=Path)
    args = ap.parse_args(argv)
    wanted = args.only.split(",")
    if "pglogical" in wanted and not Path("/usr/share/postgresql/15/extension/pglogical.control").exists():
        print(
            "pglogical 2 is not installed: run `bash bench/install-peers.sh` (as root) first", file=sys.stderr
        )
        return 2
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    command = shlex.join(["python", sys.argv[0], *(argv or sys.argv[1:])])
    work = ROOT / "bench" / "work" / f"two-way-{started:%Y%m%d-%H%M%S}"
    work.mkdir(parents=True)
    base = Path(tempfile.mkdtemp(prefix="pgcascade-twowaybench-"))
    settings = {
        "shared_buffers": "1GB",
        "shared_preload_libraries": "'pglogical'",
        "pglogical.conflict_resolution": "'last_update_wins'",
        "pglogical.conflict_log_level": "'log'",
        "wal_retrieve_retry_interval": "'100ms'",
    }
    if "pglogical" not in wanted:
        settings = {k: v for k, v in settings.items() if "pglogical" not in k}
    log(f"two clusters (fsync and synchronous_commit on); logs in {work}")
    clusters = (
        new_cluster("a", basedir=base, fast_unsafe=False, settings=settings),
        new_cluster("b", basedir=base, fast_unsafe=False, settings=settings),
    )
    kinds = (("pgcascade", PgCascade), ("pgcascade_logical", PgCascadeLogical), ("pglogical", PgLogical))
    systems: list[System] = [c() for k, c in kinds if k in wanted]
    results: dict[str, dict[str, RunFigures]] = {}
    try:
        for c in clusters:
            make_template(c, "tpl", 10)
            with c.connect("tpl") as conn:
                conn.execute("insert into heartbeat values (2, now())")
        for s in systems:
            results[s.key] = {}
            for mode, rate in (("max", None), ("rate", args.rate)):
                m = Masters(clusters, f"{s.key}_{mode}", work)
                for c in clusters:
                    clone(c, "tpl", m.dbname)
                log(f"{s.label}, {mode}: set-up")
                s.setup(m)
                try:
                    log(f"{s.label}, {mode}: pgbench on both masters for {args.seconds} s")
                    f = workload(s, m, args.seconds, args.hot, rate)
                finally:
                    s.teardown(m)
                results[s.key][mode] = f
                log(
                    f"{s.label}, {mode}: tps {f.tps[0]:.0f} + {f.tps[1]:.0f}, lag {f.lag},"
                    f" conflicts {f.conflicts}, converged in {f.converge:.2f} s, equal {f.equal}"
                )
    finally:
        PROCS.close()
        for c in clusters:
            c.destroy()
        shutil.rmtree(base, ignore_errors=True)  # 1.3-2.7 GB a run: 29 runs left behind filled the disk
    load_after = os.getloadavg()
    header = [
        f"### Two-way run of {started:%Y-%m-%d %H:%M %Z}",
        "",
        f"`{command}`; {source_info()}; {machine()}, both clusters and every daemon on this machine;"
        f" load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
        f" ({load_after[2]:.1f} over 15 minutes).",
    ]
    lines = report(results, systems, args, header)
    print("\n".join(lines))
    if args.report:  # newest first, under the file's title and introduction
        old = args.report.read_text() if args.report.exists() else ""
        head, sep, rest = old.partition("\n### ")
        run_text = "\n".join(lines) + "\n\n"
        args.report.write_text(f"{head}\n{run_text}### {rest}" if sep else run_text + old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
