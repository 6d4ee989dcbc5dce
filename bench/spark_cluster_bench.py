#!/usr/bin/env python3
"""Spark copy and compare of pgbench_accounts (scale 50: 5,000,000 rows), local[2] against a
standalone cluster whose worker is another host (a network namespace, 2 cores), on this machine.

One PostgreSQL cluster (fsync on) listening on this host's address on the worker's link; the
root and two leaves are databases of it.  Leaf "local" copies and compares with
spark_master = local[2]; leaf "cluster" with the standalone master (pgcascade.dev.sparkcluster),
its executors running in the namespace with a venv that cannot import pgcascade.  Each figure is
the whole operation as a user runs it: add-table to state ok with the worker running (the copy
process starts its own Spark), and the `compare` command (Spark start-up included).

Both "hosts" share this machine's 2 cores and one disk: the ratio is the cost of running over
the cluster (network hops, shipping pgcascade, a probe task), not a speed-up.  Needs root.

    .venv/bin/python bench/spark_cluster_bench.py [--scale 50] [--report bench/results/spark-cluster.md]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from pgcascade.dev.localcluster import LocalCluster, pg_bindir, wait_until
from pgcascade.dev.sparkcluster import SparkCluster, can_make_hosts

QUEUE = "bench"
ACCOUNTS = "public.pgbench_accounts"


def cli(ini: Path, *args: str, ok: tuple[int, ...] = (0,)) -> float:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pgcascade", str(ini), *args], capture_output=True, text=True)
    if r.returncode not in ok:
        raise SystemExit(f"pgcascade {' '.join(args)}: rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t


def write_ini(work: Path, name: str, db: str, **keys: object) -> Path:
    path = work / f"{name}.ini"
    lines = [
        "[pgcascade]",
        f"job_name = {name}",
        f"db = {db}",
        f"queue_name = {QUEUE}",
        f"logfile = {work}/{name}.log",
        f"pidfile = {work}/{name}.pid",
    ]
    path.write_text("\n".join(lines + [f"{k} = {v}" for k, v in keys.items()]) + "\n")
    return path


def copy_time(ini: Path, db: str) -> float:
    """add-table with the worker running, until the table is ok."""
    started = time.perf_counter()
    worker = subprocess.Popen(
        [sys.executable, "-m", "pgcascade", str(ini), "worker"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        cli(ini, "add-table", ACCOUNTS, "--create")

        def ok() -> bool:
            with psycopg.connect(db, autocommit=True) as c:
                row = c.execute(
                    "select state from pgcascade.subscriber_table where table_name = %s", (ACCOUNTS,)
                ).fetchone()
                return bool(row and row[0] == "ok")

        wait_until(ok, 3600, interval=0.5, what="the copy")
        return time.perf_counter() - started
    finally:
        worker.terminate()
        worker.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=50)
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()
    if reason := can_make_hosts():
        raise SystemExit(f"spark_cluster_bench: {reason}")
    work = Path(tempfile.mkdtemp(prefix="pgcascade-sparkbench-"))
    spark = SparkCluster(work / "spark")
    pg = None
    ticker = None
    try:
        spark.start(hosts=1)
        pg = LocalCluster(
            "pg", work / "pg", address=spark.address, fast_unsafe=False, settings={"shared_buffers": "1GB"}
        )
        pg.init().start()
        dbs = {n: pg.create_database(n) for n in ("root", "local", "cluster")}
        subprocess.run(
            [str(pg_bindir() / "pgbench"), "-i", "-q", "-n", "-s", str(args.scale), dbs["root"]],
            check=True,
            capture_output=True,
        )
        common = {"spark_copy_min_rows": 1_000_000, "spark_copy_range_rows": 500_000, "parallel_copies": 1}
        inis = {
            "root": write_ini(work, "root", dbs["root"]),
            "local": write_ini(
                work, "local", dbs["local"], spark_master="local[2]", spark_copy_streams=1, **common
            ),
            "cluster": write_ini(
                work,
                "cluster",
                dbs["cluster"],
                spark_master=spark.master_url,
                **{"spark.pyspark.python": spark.python, "spark.executor.memory": "2g"},
                **common,
            ),
        }
        cli(inis["root"], "create-root", "root")
        cli(inis["root"], "add-table", ACCOUNTS)
        ticker_ini = write_ini(work, "ticker", dbs["root"])
        ticker = subprocess.Popen(
            [sys.executable, "-m", "pgcascade", str(ticker_ini), "ticker"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        figures = {}
        for leaf in ("local", "cluster"):
            cli(inis[leaf], "create-leaf", leaf, "--provider", dbs["root"])
            figures[(leaf, "copy")] = copy_time(inis[leaf], dbs[leaf])
            worker = subprocess.Popen(
                [sys.executable, "-m", "pgcascade", str(inis[leaf]), "worker"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                figures[(leaf, "compare")] = cli(inis[leaf], "compare", ACCOUNTS, "--no-progress")
            finally:
                worker.terminate()
                worker.wait(60)
        rows = args.scale * 100_000
        lines = [
            f"# Spark copy and compare: local[2] against a two-host standalone cluster "
            f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
            "",
            f"- command: `.venv/bin/python bench/spark_cluster_bench.py --scale {args.scale}`",
            f"- table: pgbench_accounts, {rows:,} rows; Spark copy in ranges of 500,000 rows",
            "- cluster: a standalone master here and one worker (2 cores, 2 GB) in a network namespace,",
            "  its Python a venv without pgcascade; one PostgreSQL cluster (fsync on, shared_buffers 1GB)",
            "- both hosts share this machine's 2 cores: the ratio is the cost of going through the",
            "  cluster (network, shipping pgcascade, the executor probe), not a speed-up",
            "",
            "| operation | local[2] s | cluster s | cluster / local |",
            "| --- | ---: | ---: | ---: |",
        ]
        for op in ("copy", "compare"):
            lo, cl = figures[("local", op)], figures[("cluster", op)]
            lines.append(f"| {op} ({rows:,} rows) | {lo:.1f} | {cl:.1f} | {cl / lo:.2f} |")
        text = "\n".join(lines) + "\n"
        print(text)
        if args.report:
            args.report.write_text(text)
    finally:
        if ticker is not None:
            ticker.terminate()
            ticker.wait(60)
        if pg is not None:
            pg.destroy()
        spark.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
