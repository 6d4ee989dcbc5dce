#!/usr/bin/env python3
"""CPU the worker spends per batch at a steady write rate: its own process and its backend.

Two throwaway clusters (root and leaf), pgbench scale 10 on both (`pgbench_history` with `hid bigserial
primary key`) replicated with trigger capture and pgcascade's shipped defaults (as the replication
bench runs it).  `pgbench -n -c2 -j2 -R RATE -T SECONDS` runs on the root; the worker's CPU and its
subscriber backend's (`/proc/PID/stat`) over that time, divided by the batches it logged, are
printed.  A diagnostic, with no peer:
what a batch costs on top of its rows.

    .venv/bin/python bench/worker_cpu.py [--rate 500] [--seconds 15] [--profile [--sort cumulative]]
                                         [--callgrind]

`--profile` runs the worker under cProfile with a CPU-time clock and prints the top functions
(by their own time, or by `--sort`: any of pstats' keys).

`--callgrind` counts the worker's instructions instead (valgrind's callgrind, counters zeroed
once it runs): one client writes a `-N` transaction every 15 ms, so that the worker, ~50x
slower under valgrind, finds a batch of ~2 transactions at every round.  Instruction counts
do not move with the machine's other load, where CPU time does by 20 % from run to run: the
way to compare two versions of the worker's Python (its CPU a batch also holds the caches'
refill at every wake-up, which instructions do not show: docs/design.md, session 49).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pgcascade.dev.localcluster import new_cluster, pg_bindir

PY = sys.executable
PROFILER = """
import cProfile, sys, time
from pgcascade.cli.main import main
prof = cProfile.Profile(time.process_time)
out = sys.argv.pop(1)
prof.enable()
try:
    main()
except SystemExit:
    pass
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=500, help="pgbench transactions per second")
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sort", default="tottime", help="the profile's order (pstats' keys)")
    ap.add_argument("--callgrind", action="store_true", help="count the worker's instructions a batch")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pgcascade-worker-cpu-"))
    os.chmod(base, 0o777)  # the clusters run as postgres when we are root
    a, b = new_cluster("root", basedir=base / "a"), new_cluster("leaf", basedir=base / "b")
    procs: list[subprocess.Popen] = []
    try:
        root, leaf = a.create_database("root"), b.create_database("leaf")

        def ini(name: str, db: str) -> str:
            p = base / f"{name}.ini"
            p.write_text(
                f"[pgcascade]\njob_name = {name}\ndb = {db}\nqueue_name = q\n"
                f"logfile = {base}/{name}.log\npidfile = {base}/{name}.pid\n"
            )
            return str(p)

        def cli(*argv: str) -> None:
            subprocess.run([PY, "-m", "pgcascade", *argv], check=True, capture_output=True)

        root_ini, leaf_ini = ini("root", root), ini("leaf", leaf)
        ticker = base / "ticker.ini"
        ticker.write_text(
            f"[pgcascade]\njob_name = ticker\ndb = {root}\nlogfile = {base}/ticker.log\n"
            f"pidfile = {base}/ticker.pid\n"
        )
        subprocess.run(
            [str(pg_bindir() / "pgbench"), "-i", "-q", "-s", "10", "-n", root],
            check=True,
            capture_output=True,
        )
        with a.connect("root") as c:
            c.execute("alter table pgbench_history add column hid bigserial primary key")
        # the leaf holds the rows too (--expect-sync below): updates find their rows, as in use
        dump = subprocess.Popen(
            [str(pg_bindir() / "pg_dump"), "-t", "pgbench_*", root], stdout=subprocess.PIPE
        )
        subprocess.run(
            [str(pg_bindir() / "psql"), "-q", "-X", leaf], stdin=dump.stdout, check=True, capture_output=True
        )
        if dump.wait() != 0:
            raise SystemExit("pg_dump of the root's pgbench tables failed")
        cli(root_ini, "create-root", "root")
        cli(leaf_ini, "create-leaf", "leaf", "--provider", root)
        cli(root_ini, "add-table", "--all")
        cli(leaf_ini, "add-table", "--all", "--expect-sync")
        cli(root_ini, "add-seq", "--all")
        cli(leaf_ini, "add-seq", "--all")
        procs.append(subprocess.Popen([PY, "-m", "pgcascade", "ticker", str(ticker)]))
        prof = base / "worker.prof"
        counts = base / "worker.callgrind"
        cmd = (
            [PY, "-c", PROFILER, str(prof), leaf_ini, "worker"]
            if args.profile
            else [PY, "-m", "pgcascade", leaf_ini, "worker"]
        )
        if args.callgrind:
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={counts}", *cmd]
        worker = subprocess.Popen(cmd)
        procs.append(worker)
        time.sleep(30 if args.callgrind else 3)  # (valgrind: the imports take ~20 s)
        with b.connect("leaf") as c:
            backend = c.execute(
                "select pid from pg_stat_activity where application_name = 'pgcascade worker'"
            ).fetchone()[0]
        log = base / "leaf.log"

        def batches() -> int:
            return log.read_text().count("{count:")

        if args.callgrind:
            subprocess.run(["callgrind_control", "--zero", str(worker.pid)], check=True, capture_output=True)
        w0, b0, n0 = cpu_seconds(worker.pid), cpu_seconds(backend), batches()
        load = [str(pg_bindir() / "pgbench"), "-n", "-T", str(args.seconds)]
        if args.callgrind:  # one client, a transaction every 15 ms
            builtin = subprocess.run(  # pgbench's -N transaction, as pgbench shows it
                [load[0], "--show-script=simple-update"], check=True, capture_output=True, text=True
            ).stderr
            (base / "paced.sql").write_text(builtin + "\\sleep 15 ms\n")
            load += ["-c", "1", "-f", str(base / "paced.sql")]
        else:
            load += ["-c", "2", "-j", "2", "-R", str(args.rate)]
        subprocess.run([*load, root], check=True, capture_output=True)
        time.sleep(1)
        n = batches() - n0
        if args.callgrind:
            subprocess.run(["callgrind_control", "--dump", str(worker.pid)], check=True, capture_output=True)
            dumped = max(base.glob("worker.callgrind.*"), key=lambda f: f.stat().st_mtime).read_text()
            total = int(next(line for line in dumped.splitlines() if line.startswith("totals:")).split()[1])
            print(f"{n} batches: the worker's instructions {total / n:,.0f} a batch")
        w, bk = cpu_seconds(worker.pid) - w0, cpu_seconds(backend) - b0
        print(
            f"{n} batches in {args.seconds} s at {'~60' if args.callgrind else args.rate} tps:"
            f" worker process {1000 * w / n:.2f} ms"
            f" per batch, its backend {1000 * bk / n:.2f} ms"
        )
        for p in procs:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)
        if args.profile:
            import pstats

            pstats.Stats(str(prof)).sort_stats(args.sort).print_stats(40)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        a.destroy()
        b.destroy()


if __name__ == "__main__":
    sys.exit(main())
