#!/usr/bin/env python3
"""Spark pipeline benchmark: compare and copy of pgbench_accounts at scale 50 (5,000,000 rows).

Two fresh clusters on loopback (shared_buffers=1GB, fsync and synchronous_commit on), as in
../shared/anchors/README.md (W3, W4).  One run measures, in this order:

copy (into an empty subscriber table with the provider's definition):
  pipe        `psql \\copy ... to stdout | psql \\copy ... from stdin` into an unindexed table,
              then ALTER TABLE ADD PRIMARY KEY
  native      CREATE SUBSCRIPTION until the table is 'r'
  pgcascade   leaf add-table, worker started, until the table's state is ok: its single COPY
              pipe (spark_copy_min_rows = off), the Spark copy cold (Spark started by the copy
              process) and warm (attached to a running Spark Connect server)

Before each timed copy both clusters are checkpointed and the page cache's dirty data written
out (`settle`), so that no copy pays for the writeback of the one before; the pipe is timed
again last, as a drift check.

compare (the Spark copy's leaf against the root, ticker and worker running), (a) identical,
(b) 5,000 rows different on the subscriber (1,666 deleted, 1,666 changed, 1,668 extra):
  pgcascade compare, cold (the CLI starts Spark) and warm (spark_remote), whole command timed
  seed method: ordered COPY of both sides, streaming merge of the lines in Python
  checksum floor: count(*) + sum(hashtext(row)) on both sides at once (says only "differs")
  reladiff (if /tmp/reladiff-venv exists), -j 2 --bisection-threshold 200000, -k aid -c ...
Londiste 3's repair needs pgqd, which is not installed here: its figures are cited from the
anchors, not measured in this run.

    .venv/bin/python bench/pipeline_bench.py [--report bench/results/pipeline.md] [--scale 50]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

from pgcascade.dev.localcluster import LocalCluster, new_cluster, pg_bindir

PGCASCADE = [sys.executable, "-m", "pgcascade"]
RELADIFF = Path("/tmp/reladiff-venv/bin/reladiff")
SETTINGS = {"shared_buffers": "1GB", "max_wal_size": "4GB", "checkpoint_timeout": "30min"}


def log(msg: str) -> None:
    print(f"{datetime.datetime.now():%H:%M:%S} {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], timeout: float = 1800, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, cmd[:4]))}...: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        )
    return r


def timed(fn) -> tuple[float, object]:
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out


def dirty_mb() -> float:
    """Dirty and writeback page cache, MB (/proc/meminfo)."""
    kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(("Dirty:", "Writeback:")):
            kb += int(line.split()[1])
    return kb / 1024


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


class Bench:
    def __init__(self, scale: int, work: Path):
        self.scale = scale
        self.work = work
        self.prov = new_cluster("prov", basedir=work / "prov", settings=SETTINGS, fast_unsafe=False)
        self.sub = new_cluster("sub", basedir=work / "sub", settings=SETTINGS, fast_unsafe=False)
        self.results: dict[str, float | str] = {}
        self.daemons: list[subprocess.Popen] = []

    def dsn(self, c: LocalCluster, db: str) -> str:
        return c.connstr(db)

    def ini(self, name: str, db: str, **extra: object) -> Path:
        path = self.work / f"{name}.ini"
        lines = [
            "[pgcascade]",
            f"job_name = {name}",
            f"db = {db}",
            "queue_name = bench",
            f"logfile = {self.work}/{name}.log",
            f"pidfile = {self.work}/{name}.pid",
            f"spark_server_dir = {self.work}/spark-server",
            *(f"{k} = {v}" for k, v in extra.items()),
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    def cli(
        self, ini: Path, *args: str, check: bool = True, timeout: float = 1800
    ) -> subprocess.CompletedProcess[str]:
        return run([*PGCASCADE, str(ini), *args], check=check, timeout=timeout)

    def daemon(self, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([*PGCASCADE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.daemons.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.terminate()
            p.wait(timeout=60)

    def close(self) -> None:
        for p in self.daemons:
            self.stop(p)
        for c in (self.prov, self.sub):
            c.destroy()

    # --- set-up ---

    def setup(self) -> None:
        self.prov.create_database("bench")
        log(f"pgbench -i -s {self.scale}")
        run(
            [
                str(pg_bindir() / "pgbench"),
                "-i",
                "-q",
                "-I",
                "dtgvp",
                "-s",
                str(self.scale),
                self.dsn(self.prov, "bench"),
            ]
        )
        with psycopg.connect(self.dsn(self.prov, "bench"), autocommit=True) as conn:
            conn.execute("vacuum analyze pgbench_accounts")
            conn.execute("checkpoint")
        self.root_ini = self.ini("root", self.dsn(self.prov, "bench"))
        self.cli(self.root_ini, "create-root", "root")
        self.cli(self.root_ini, "add-table", "pgbench_accounts")
        ticker = self.work / "ticker.ini"
        ticker.write_text(
            f"[pgcascade]\njob_name = ticker\ndb = {self.dsn(self.prov, 'bench')}\n"
            f"logfile = {self.work}/ticker.log\npidfile = {self.work}/ticker.pid\n"
        )
        self.daemon("ticker", str(ticker))
        self.server_ini = self.ini("server", self.dsn(self.sub, "postgres"))

    def empty_table(self, db: str, indexed: bool) -> None:
        self.sub.create_database(db)
        with psycopg.connect(self.dsn(self.sub, db), autocommit=True) as conn:
            pk = " primary key" if indexed else " not null"
            conn.execute(
                f"create table pgbench_accounts (aid int{pk}, bid int, abalance int, filler char(84))"
            )
            conn.execute("alter table pgbench_accounts set (fillfactor = 100)")

    # --- copy ---

    def settle(self) -> None:
        """Before a timed copy: both clusters checkpointed and the page cache's dirty data
        written out, so that no copy pays for the writeback of the one before it (each copy
        writes ~1.2 GB of table and WAL; unsettled, the later ones measured up to 2x slower)."""
        for c in (self.prov, self.sub):
            with psycopg.connect(self.dsn(c, "postgres"), autocommit=True) as conn:
                conn.execute("checkpoint")
        os.sync()
        deadline = time.monotonic() + 60
        while dirty_mb() > 64 and time.monotonic() < deadline:
            time.sleep(0.5)

    def copy_pipe(self, db: str = "pipe") -> float:
        self.empty_table(db, indexed=False)
        self.settle()
        psql = str(pg_bindir().parent / "bin" / "psql") if (pg_bindir() / "psql").exists() else "psql"
        out = f"{psql} -X -q -c '\\copy pgbench_accounts to stdout' '{self.dsn(self.prov, 'bench')}'"
        into = f"{psql} -X -q -c '\\copy pgbench_accounts from stdin' '{self.dsn(self.sub, db)}'"
        t = time.monotonic()
        run(["bash", "-o", "pipefail", "-c", f"{out} | {into}"])
        with psycopg.connect(self.dsn(self.sub, db), autocommit=True) as conn:
            conn.execute("alter table pgbench_accounts add primary key (aid)")
        return time.monotonic() - t

    def copy_native(self) -> float:
        self.empty_table("native", indexed=True)
        with psycopg.connect(self.dsn(self.prov, "bench"), autocommit=True) as conn:
            conn.execute("create publication benchpub for table pgbench_accounts")
        self.settle()
        with psycopg.connect(self.dsn(self.sub, "native"), autocommit=True) as conn:
            t = time.monotonic()
            conn.execute(
                f"create subscription benchsub connection '{self.dsn(self.prov, 'bench')}' publication benchpub"
            )
            while conn.execute("select count(*) from pg_subscription_rel where srsubstate <> 'r'").fetchone()[
                0
            ]:
                time.sleep(0.05)
            took = time.monotonic() - t
            conn.execute("drop subscription benchsub")
        with psycopg.connect(self.dsn(self.prov, "bench"), autocommit=True) as conn:
            conn.execute("drop publication benchpub")
        return took

    def copy_pgcascade(self, db: str, **extra: object) -> tuple[float, Path, subprocess.Popen]:
        """Leaf add-table, then the worker: seconds until the table is ok."""
        self.sub.create_database(db)
        ini = self.ini(db, self.dsn(self.sub, db), **extra)
        self.cli(ini, "create-leaf", db, "--provider", self.dsn(self.prov, "bench"))
        self.cli(ini, "add-table", "pgbench_accounts", "--create")
        self.settle()
        t = time.monotonic()
        worker = self.daemon(str(ini), "worker")
        with psycopg.connect(self.dsn(self.sub, db), autocommit=True) as conn:
            while conn.execute("select state from pgcascade.subscriber_table").fetchone()[0] != "ok":
                if worker.poll() is not None:
                    raise RuntimeError(f"worker of {db} exited; see {self.work}/{db}.log")
                time.sleep(0.05)
        return time.monotonic() - t, ini, worker

    # --- compare ---

    def pgcascade_compare(self, ini: Path) -> tuple[float, str]:
        t = time.monotonic()
        r = self.cli(ini, "compare", "pgbench_accounts", "--no-progress", check=False)
        took = time.monotonic() - t
        if r.returncode not in (0, 3):
            raise RuntimeError(f"compare failed: {r.stderr}")
        return took, r.stdout.strip().splitlines()[0]  # the table's line; the sample keys follow

    def seed_method(self, db: str) -> tuple[float, str]:
        """Ordered COPY of both sides, merged line by line (Python), as the seed describes."""

        def stream(dsn: str):
            conn = psycopg.connect(dsn)
            cur = conn.cursor()
            with cur.copy("copy (select * from pgbench_accounts order by aid) to stdout") as cp:
                for block in cp:
                    yield bytes(block)
            conn.close()

        def key(line: bytes | None) -> int | None:
            return None if line is None else int(line.split(b"\t", 1)[0])

        t = time.monotonic()
        a, b = stream(self.dsn(self.prov, "bench")), stream(self.dsn(self.sub, db))
        la, lb = next(a, None), next(b, None)
        missing = extra = different = 0
        while la is not None or lb is not None:
            ka, kb = key(la), key(lb)
            if kb is None or (ka is not None and ka < kb):
                missing += 1
                la = next(a, None)
            elif ka is None or kb < ka:
                extra += 1
                lb = next(b, None)
            else:
                different += la != lb
                la, lb = next(a, None), next(b, None)
        return time.monotonic() - t, f"missing {missing}, extra {extra}, different {different}"

    def checksum_floor(self, db: str) -> tuple[float, str]:
        out: dict[str, tuple] = {}

        def one(name: str, dsn: str) -> None:
            with psycopg.connect(dsn) as conn:
                out[name] = conn.execute(
                    "select count(*), sum(hashtext(t::text)) from pgbench_accounts t"
                ).fetchone()

        t = time.monotonic()
        threads = [
            threading.Thread(target=one, args=("p", self.dsn(self.prov, "bench"))),
            threading.Thread(target=one, args=("s", self.dsn(self.sub, db))),
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.monotonic() - t, "equal" if out["p"] == out["s"] else "differs"

    def reladiff(self, db: str) -> tuple[float, str]:
        def url(c: LocalCluster, d: str) -> str:
            return f"postgresql://postgres@127.0.0.1:{c.port}/{d}"

        t = time.monotonic()
        r = run(
            [
                str(RELADIFF),
                url(self.prov, "bench"),
                "pgbench_accounts",
                url(self.sub, db),
                "pgbench_accounts",
                "-k",
                "aid",
                "-c",
                "bid",
                "-c",
                "abalance",
                "-c",
                "filler",
                "-j",
                "2",
                "--bisection-threshold",
                "200000",
            ],
            check=False,
        )
        took = time.monotonic() - t
        lines = [x for x in r.stdout.splitlines() if x[:1] in "+-"]
        return (
            took,
            f"{sum(x.startswith('-') for x in lines)} '-' and {sum(x.startswith('+') for x in lines)} '+' rows (rc {r.returncode})",
        )

    def plant(self, db: str) -> None:
        with psycopg.connect(self.dsn(self.sub, db), autocommit=True) as conn:
            conn.execute("set session_replication_role = replica")
            conn.execute("delete from pgbench_accounts where aid % 3000 = 1")
            conn.execute("update pgbench_accounts set abalance = abalance + 1 where aid % 3000 = 2")
            n = self.scale * 100000
            conn.execute(
                "insert into pgbench_accounts select g, 1, 0, '' from generate_series(%s, %s) g",
                (n + 1, n + 1668),
            )
            conn.execute("vacuum analyze pgbench_accounts")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=50)
    ap.add_argument("--report", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each compare figure (median reported)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # clusters and daemons are cleaned up on kill too
    work = Path(tempfile.mkdtemp(prefix="pgcascade-pipeline-bench-"))
    work.chmod(0o755)
    b = Bench(args.scale, work)
    res: list[tuple[str, str, float, str]] = []  # (section, what, seconds, note)
    loads = [loadavg()]
    started = time.monotonic()
    try:
        b.setup()
        log("copy: single pipe")
        res.append(("copy", "single COPY pipe into an unindexed table + ADD PRIMARY KEY", b.copy_pipe(), ""))
        log("copy: native logical replication")
        res.append(("copy", "native logical replication initial sync", b.copy_native(), ""))
        log("copy: pgcascade, its single COPY pipe")
        took, _, w = b.copy_pgcascade("plain", spark_copy_min_rows="off")
        b.stop(w)
        res.append(("copy", "pgcascade leaf add-table, one COPY pipe (until ok)", took, ""))
        log("copy: pgcascade Spark copy, cold")
        took, leaf_ini, _leaf_worker = b.copy_pgcascade(
            "sparkcold", spark_copy_min_rows=1000000, spark_copy_streams=1, spark_master="local[*]"
        )
        res.append(("copy", "pgcascade Spark copy, cold: Spark started by the copy (until ok)", took, ""))
        log("starting the Spark Connect server")
        t_server, _ = timed(lambda: b.cli(b.server_ini, "spark-server", "start"))
        res.append(("setup", "Spark Connect server start (paid once)", t_server, ""))
        remote = "sc://127.0.0.1:15002"
        log("copy: pgcascade Spark copy, warm")
        took, _, w = b.copy_pgcascade("sparkwarm", spark_copy_min_rows=1000000, spark_remote=remote)
        b.stop(w)
        res.append(("copy", "pgcascade Spark copy, warm: attached to Spark Connect (until ok)", took, ""))
        log("copy: single pipe again")
        res.append(
            ("copy", "single COPY pipe again, after the others (drift check)", b.copy_pipe("pipe2"), "")
        )
        warm_ini = b.ini("sparkcold-warm", b.dsn(b.sub, "sparkcold"), spark_remote=remote)
        for case in ("a: identical", "b: 0.1% different"):
            if case.startswith("b"):
                b.plant("sparkcold")
            figures = [
                ("pgcascade compare, cold (CLI starts Spark)", lambda: b.pgcascade_compare(leaf_ini)),
                ("pgcascade compare, warm (Spark Connect)", lambda: b.pgcascade_compare(warm_ini)),
                ("seed method: ordered COPY both sides + line merge", lambda: b.seed_method("sparkcold")),
                (
                    "checksum floor: count + sum(hashtext(row)), both sides at once",
                    lambda: b.checksum_floor("sparkcold"),
                ),
            ]
            if RELADIFF.exists():
                figures.append(
                    ("reladiff -j 2 --bisection-threshold 200000", lambda: b.reladiff("sparkcold"))
                )
            for what, fn in figures:
                times, note = [], ""
                for _ in range(args.rounds):
                    log(f"compare {case}: {what}")
                    t, note = fn()
                    times.append(t)
                times.sort()
                res.append(
                    (
                        f"compare {case}",
                        what,
                        times[len(times) // 2],
                        f"{note} [{', '.join(f'{x:.1f}' for x in times)}]",
                    )
                )
        loads.append(loadavg())
        b.cli(b.server_ini, "spark-server", "stop", check=False)
    finally:
        b.close()
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"# Spark pipeline benchmark ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"pgbench_accounts at scale {args.scale} ({args.scale * 100000:,} rows) on two fresh clusters, this machine"
        f" ({os.cpu_count()} cores, shared with other engineers' test runs: load average {' -> '.join(loads)});"
        f" whole run {time.monotonic() - started:.0f} s. Compare figures: median of {args.rounds} runs [each run].",
        "",
        "| section | what | seconds | result |",
        "|---|---|---|---|",
    ]
    lines += [f"| {s} | {w} | {t:.1f} | {n} |" for s, w, t, n in res]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report:
        Path(args.report).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
