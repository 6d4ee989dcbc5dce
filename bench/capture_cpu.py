#!/usr/bin/env python3
"""Server CPU per TPC-B transaction on the root, by capture mode: none, trigger, logical, londiste.

One throwaway cluster (fsync and synchronous_commit on, shared_buffers 1GB), pgbench scale 1
(`pgbench_history` with `hid bigserial primary key`), one client: `pgbench -n -c1 -t N` ROUNDS
times per mode, the order rotating; the median is reported.  The CPU is that of pgbench's
server backend (`/proc/PID/stat` utime + stime, sampled every 10 ms until it exits): what the
application's own transactions cost the server.  The logical mode runs its capture daemon; its
Python CPU and its database backend's (which decodes the WAL and inserts the events) are
reported apart: they run off the application's path, but on the same machine.  `londiste` is
Londiste 3's capture: PgQ's C trigger `pgq.logutriga` on the tables (bench/install-peers.sh).
`--single` runs single-row UPDATEs of pgbench_accounts, each its own transaction, instead of
TPC-B: the trigger's cost per statement.

    .venv/bin/python bench/capture_cpu.py [--txns 4000] [--rounds 3] [--modes none,trigger,logical,londiste]
                                          [--variant NAME=FILE.sql ...] [--single] [--callgrind]

`--variant NAME=FILE.sql` adds a trigger mode whose capture functions come from FILE.sql (an
older 90_capture.sql, say): measured in the same run, interleaved, so that the comparison
holds on a loaded machine.

`--callgrind` counts instructions instead: the server runs under valgrind's callgrind and each
mode's pgbench runs `--txns` then twice as many transactions; the client backend's instructions
per transaction are the difference over `--txns` (its connection and first plans cancel out).
Instruction counts repeat to the last digit whatever else the machine does, where CPU time
moves by 10 % from hour to hour: the way to compare two capture functions that differ by a few
percent.  Slow (valgrind: ~50x): `--txns 200` takes a minute a mode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pgcascade.capture import logical
from pgcascade.dev.localcluster import LocalCluster, _as_server_user, new_cluster, pg_bindir

PGBENCH = str(pg_bindir() / "pgbench")
PGCASCADE = [sys.executable, "-m", "pgcascade"]
TABLES = ["pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history"]
TICK = os.sysconf("SC_CLK_TCK")


def proc_times(pid: int, children: bool) -> float:
    """CPU seconds of a process (and of its reaped children, when asked)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ut, st, cut, cst = (int(x) for x in fields[11:15])
    return (ut + st + (cut + cst if children else 0)) / TICK


def cli(ini: Path, *args: str) -> None:
    r = subprocess.run([*PGCASCADE, str(ini), *args], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"pgcascade {' '.join(args)}: {r.stderr.strip()}")


def prepare(
    c: LocalCluster, work: Path, mode: str, variant_sql: str | None = None
) -> subprocess.Popen | None:
    """A fresh database `cpu_MODE` with pgbench tables and the mode's capture set up."""
    db = f"cpu_{mode}"
    with c.connect() as conn:
        conn.execute(f'drop database if exists "{db}" with (force)')
        conn.execute(f'create database "{db}"')
    subprocess.run([PGBENCH, "-i", "-q", "-s", "1", c.connstr(db)], check=True, capture_output=True)
    with c.connect(db) as conn:
        conn.execute("alter table pgbench_history add column hid bigserial primary key")
        conn.execute("vacuum analyze")
    if mode == "none":
        return None
    if mode == "londiste":
        with c.connect(db) as conn:
            conn.execute("create extension pgq")
            conn.execute("select pgq.create_queue('q')")
            for t in TABLES:
                conn.execute(
                    f"create trigger _londiste_q after insert or update or delete on {t}"
                    " for each row execute procedure pgq.logutriga('q')"
                )
        return None
    ini = work / f"{mode}.ini"
    ini.write_text(
        f"[pgcascade]\njob_name = cap_{mode}\ndb = {c.connstr(db)}\nqueue_name = q\n"
        f"logfile = {work}/{mode}.log\npidfile = {work}/{mode}.pid\n"
    )
    cli(ini, "create-root", "root", *(["--capture=logical"] if mode == "logical" else []))
    cli(ini, "add-table", *TABLES)
    if variant_sql is not None:
        with c.connect(db) as conn:
            conn.execute(variant_sql.encode())
            conn.execute(
                "select pgcascade.capture_enable(queue_name, table_name::regclass, key_columns, event_format)"
                " from pgcascade.set_table"
            )
    if mode == "logical":
        log = (work / f"{mode}.out").open("ab")
        p = subprocess.Popen([*PGCASCADE, str(ini), "capture"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while len(capture_backend_pids(c, db)) < 2:
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError(f"the capture daemon did not connect (see {work}/{mode}.out)")
            time.sleep(0.1)
        return p
    return None


def capture_backend_pids(c: LocalCluster, db: str) -> list[int]:
    """The capture daemon's backends: the reader (decodes the WAL) and the writer (inserts)."""
    with c.connect(db) as conn:
        rows = conn.execute(
            "select pid from pg_stat_activity where datname = current_database()"
            " and application_name like 'pgcascade capture%'"
        ).fetchall()
    return [r[0] for r in rows]


def start_pgbench(c: LocalCluster, db: str, txns: int, script: Path | None) -> subprocess.Popen:
    """pgbench with one client: TPC-B, or `script`."""
    return subprocess.Popen(
        [PGBENCH, "-n", "-c1", "-t", str(txns), *(["-f", str(script)] if script else []), c.connstr(db)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def backend_cpu_of_run(c: LocalCluster, db: str, txns: int, script: Path | None = None) -> float:
    """Run pgbench (TPC-B, or `script`) and return the CPU seconds of its server backend
    (sampled every 10 ms until it exits: at most 10 ms short)."""
    p = start_pgbench(c, db, txns, script)
    # pgbench connects once to look at the tables, then for its client: follow every backend
    seen: dict[int, float] = {}
    with c.connect(db) as conn:
        while p.poll() is None:
            for (pid,) in conn.execute(
                "select pid from pg_stat_activity where datname = current_database()"
                " and application_name = 'pgbench'"
            ).fetchall():
                seen[pid] = max(seen.get(pid, 0.0), proc_times(pid, children=False))
            for pid in seen:
                seen[pid] = max(seen[pid], proc_times(pid, children=False))
            time.sleep(0.01)
    if p.wait() != 0:
        raise RuntimeError(f"pgbench failed: {p.stderr.read().decode()}")
    return sum(seen.values())


def callgrind_server(c: LocalCluster, out: Path) -> subprocess.Popen:
    """The cluster restarted with its postmaster (and so every backend) under callgrind."""
    c.stop()
    out.mkdir(exist_ok=True)
    out.chmod(0o777)  # the server's user writes there
    p = subprocess.Popen(
        [
            *_as_server_user(),
            "valgrind",
            "--tool=callgrind",
            "--trace-children=yes",
            f"--callgrind-out-file={out}/cg.%p",
            str(pg_bindir() / "postgres"),
            "-D",
            str(c.datadir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while True:
        try:
            with c.connect():
                return p
        except Exception:
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("the server did not start under valgrind") from None
            time.sleep(1)


def callgrind_instructions(c: LocalCluster, out: Path, mode: str, txns: int, script: Path | None) -> int:
    """Instructions of the pgbench client's backend (read from its callgrind file at its exit)."""
    seen = set(out.iterdir())
    p = start_pgbench(c, f"cpu_{mode}", txns, script)
    if p.wait() != 0:
        raise RuntimeError(f"pgbench failed: {p.stderr.read().decode()}")  # type: ignore[union-attr]
    best, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline:  # each backend writes its file as it exits
        time.sleep(2)
        for f in set(out.iterdir()) - seen:
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    best = max(best, int(line.split()[1]))
                    break
        if best:
            return best
    raise RuntimeError("no callgrind output from pgbench's backend")


def callgrind_main(c: LocalCluster, work: Path, modes: list[str], txns: int, script: Path | None) -> None:
    """Instructions per transaction of each mode's writer backend, and over the first mode's."""
    server = callgrind_server(c, work / "callgrind")
    try:
        per = {}
        for m in modes:
            small = callgrind_instructions(c, work / "callgrind", m, txns, script)
            large = callgrind_instructions(c, work / "callgrind", m, 2 * txns, script)
            per[m] = (large - small) / txns
            print(f"{m}: {per[m]:,.0f} instructions a transaction")
    finally:
        c.stop()  # pg_ctl signals the postmaster itself (runuser passes no signal on)
        server.wait(timeout=120)
        shutil.rmtree(work / "callgrind", ignore_errors=True)  # a file per backend, megabytes each
    print(f"\n| mode | instructions per transaction (callgrind) | over {modes[0]} |")
    print("| --- | ---: | ---: |")
    for m in modes:
        print(f"| {m} | {per[m]:,.0f} | {per[m] - per[modes[0]]:+,.0f} |")


def run_round(
    c: LocalCluster, mode: str, txns: int, daemon: subprocess.Popen | None, script: Path | None = None
) -> dict:
    db = f"cpu_{mode}"
    with c.connect() as conn:
        conn.execute("checkpoint")
    dpid = daemon.pid if daemon else None
    bpids = capture_backend_pids(c, db) if daemon else []
    d0 = proc_times(dpid, False) if dpid else 0.0
    b0 = sum(proc_times(p, False) for p in bpids)
    t0 = time.monotonic()
    cpu = backend_cpu_of_run(c, db, txns, script)
    if daemon:
        with c.connect(db) as conn:
            logical.wait_captured(conn, "q", 120)  # the wait wait-sync makes
    wall = time.monotonic() - t0
    d1 = proc_times(dpid, False) if dpid else 0.0
    b1 = sum(proc_times(p, False) for p in bpids)
    return {
        "server_us": cpu / txns * 1e6,
        "daemon_us": (d1 - d0) / txns * 1e6,
        "capture_backend_us": (b1 - b0) / txns * 1e6,
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--txns", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="none,trigger")
    ap.add_argument(
        "--variant", action="append", default=[], help="NAME=FILE.sql: trigger capture with these functions"
    )
    ap.add_argument("--single", action="store_true", help="single-row UPDATEs instead of TPC-B")
    ap.add_argument("--callgrind", action="store_true", help="count the writer's instructions (valgrind)")
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    modes = args.modes.split(",") + list(variants)
    work = Path(tempfile.mkdtemp(prefix="pgcascade-cpu-"))
    work.chmod(0o755)
    script = None
    if args.single:
        script = work / "single.sql"
        script.write_text(
            "\\set aid random(1, 100000)\nupdate pgbench_accounts set abalance = abalance + 1 where aid = :aid;\n"
        )
    c = new_cluster(
        "cpu",
        basedir=work / "cluster",
        fast_unsafe=False,
        settings={"shared_buffers": "1GB", "synchronous_commit": "on"},
    )
    daemons: dict[str, subprocess.Popen | None] = {}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for m in modes:
            daemons[m] = prepare(c, work, m, Path(variants[m]).read_text() if m in variants else None)
        if args.callgrind:
            callgrind_main(c, work, modes, args.txns, script)
            return 0
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
            for m in order:
                r = run_round(c, m, args.txns, daemons[m], script)
                results[m].append(r)
                print(f"round {rnd + 1} {m}: server {r['server_us']:.0f} us/txn, daemon {r['daemon_us']:.0f}")
    finally:
        for p in daemons.values():
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGINT)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
        c.destroy()
    base = statistics.median(r["server_us"] for r in results[modes[0]])
    print(
        f"\n| mode | backend CPU per txn (median) | over {modes[0]} | capture daemon | its backend | runs |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for m in modes:
        med = statistics.median(r["server_us"] for r in results[m])
        dmed = statistics.median(r["daemon_us"] for r in results[m])
        bmed = statistics.median(r["capture_backend_us"] for r in results[m])
        runs = ", ".join(f"{r['server_us']:.0f}" for r in results[m])
        print(f"| {m} | {med:.0f} µs | {med - base:+.0f} µs | {dmed:.0f} µs | {bmed:.0f} µs | {runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
