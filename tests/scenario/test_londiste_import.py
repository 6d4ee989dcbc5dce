"""Moving a live Londiste 3 set to pgcascade without copying again (import-londiste), with the
real Londiste 3, PgQ and pgqd from Debian.  pgbench writes on the root throughout: the root is
imported, the leaf's Londiste worker applies the last PgQ tick and stops, the leaf is imported,
and pgcascade's worker continues.  The leaf ends equal to the root (md5 of every row, computed
by PostgreSQL), with every history row once (pgbench_history has a primary key)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from conftest import Daemons, run_cli, table_checksum
from test_replication import PGBENCH_TABLES, pgbench, pgbench_init

from pgcascade.dev.localcluster import wait_until

QUEUE = "lq"
LONDISTE = ["/usr/bin/python3", "/usr/bin/londiste"]  # Debian's, on the system Python (psycopg2)


def write_ini(path: Path, section: str, **keys: object) -> Path:
    path.write_text(f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))
    return path


def londiste(ini: Path, *args: str) -> str:
    r = subprocess.run([*LONDISTE, str(ini), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"londiste {' '.join(args)}: {r.stdout}\n{r.stderr}"
    return r.stdout


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_a_live_londiste_set_moves_to_pgcascade_without_a_copy(tmp_path: Path, make_db, daemons: Daemons):
    root, leaf = make_db("a"), make_db("b")
    for db in (root, leaf):
        pgbench_init(db)  # the same rows on both: the leaf's tables are in sync from the start
        with db.connect() as conn:
            for ext in ("pgq", "pgq_node", "londiste"):
                conn.execute(f"create extension {ext}")
    l_root = write_ini(
        tmp_path / "l_root.ini",
        "londiste",
        job_name="l_root",
        db=root.connstr,
        queue_name=QUEUE,
        logfile=tmp_path / "l_root.log",
        pidfile=tmp_path / "l_root.pid",
    )
    l_leaf = write_ini(
        tmp_path / "l_leaf.ini",
        "londiste",
        job_name="l_leaf",
        db=leaf.connstr,
        queue_name=QUEUE,
        logfile=tmp_path / "l_leaf.log",
        pidfile=tmp_path / "l_leaf.pid",
        loop_delay=0.2,
    )
    londiste(l_root, "create-root", "root", root.connstr)
    londiste(l_leaf, "create-leaf", "leaf", leaf.connstr, f"--provider={root.connstr}")
    londiste(l_root, "add-table", *PGBENCH_TABLES)
    londiste(l_root, "add-seq", "pgbench_history_hid_seq")
    londiste(l_leaf, "add-table", *PGBENCH_TABLES, "--expect-sync")
    londiste(l_leaf, "add-seq", "pgbench_history_hid_seq")
    pgqd_ini = write_ini(
        tmp_path / "pgqd.ini",
        "pgqd",
        base_connstr=root.cluster.connstr("postgres").rsplit(" dbname=", 1)[0],
        initial_database="postgres",
        database_list=f"{root.name},{leaf.name}",
        logfile=tmp_path / "pgqd.log",
        pidfile=tmp_path / "pgqd.pid",
        ticker_period=0.1,
    )
    pgqd = subprocess.Popen(
        ["/usr/bin/pgqd", str(pgqd_ini)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    worker = subprocess.Popen(
        [*LONDISTE, str(l_leaf), "worker"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        load = pgbench(root, "-c", "2", "-j", "2", "-T", "25", "-R", "120")
        time.sleep(4)
        with leaf.connect() as conn:
            assert conn.execute("select count(*) from pgbench_history").fetchone()[0] > 0, (
                "Londiste applies nothing"
            )

        pgc = {}
        for name, db in (("root", root), ("leaf", leaf)):
            pgc[name] = write_ini(
                tmp_path / f"{name}.ini",
                "pgcascade",
                job_name=name,
                db=db.connstr,
                queue_name=QUEUE,
                logfile=tmp_path / f"{name}.log",
                pidfile=tmp_path / f"{name}.pid",
                loop_delay=0.2,
            )
        r = run_cli(str(pgc["root"]), "import-londiste", str(l_root), "--dry-run")
        assert r.returncode == 0 and "node root (root) of queue lq becomes a pgcascade root" in r.stdout, r
        r = run_cli(str(pgc["root"]), "import-londiste", str(l_root))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "root is the pgcascade root of lq" in r.stdout, r.stdout
        ticker_ini = write_ini(
            tmp_path / "ticker.ini",
            "pgcascade",
            job_name="ticker",
            db=root.connstr,
            logfile=tmp_path / "ticker.log",
            pidfile=tmp_path / "ticker.pid",
            ticker_period=0.05,
        )
        daemons.start("ticker", str(ticker_ini))
        daemons.start(str(pgc["root"]), "worker")

        # the leaf's Londiste worker still runs: the import refuses until it has stopped
        r = run_cli(str(pgc["leaf"]), "import-londiste", str(l_leaf))
        assert r.returncode == 2 and "stop it first" in r.stderr, r.stderr
        with root.connect() as conn:
            final = conn.execute("select pgq_final_tick from pgcascade.londiste_import").fetchone()[0]

        def londiste_applied() -> int:
            with leaf.connect() as conn:
                return conn.execute(
                    "select worker_last_tick from pgq_node.get_node_info(%s)", (QUEUE,)
                ).fetchone()[0]

        wait_until(lambda: londiste_applied() >= final, 60, what="Londiste's leaf to apply the last PgQ tick")
        stop(worker)
        r = run_cli(str(pgc["leaf"]), "import-londiste", str(l_leaf))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "leaf is a pgcascade leaf of root, 4 tables" in r.stdout, r.stdout
        daemons.start(str(pgc["leaf"]), "worker")
        assert load.wait(timeout=90) == 0, load.stderr.read()
        with root.connect() as conn:
            target = conn.execute("select pgcascade.ticker(%s)", (QUEUE,)).fetchone()[0]

        def leaf_applied() -> int:
            with leaf.connect() as conn:
                return conn.execute("select last_tick from pgcascade.node").fetchone()[0]

        wait_until(lambda: leaf_applied() >= target, 90, what="the leaf to apply the root's last tick")
        for t in PGBENCH_TABLES:
            assert table_checksum(root, t) == table_checksum(leaf, t), f"{t} differs"
        with root.connect() as conn:
            history = conn.execute("select count(*) from pgbench_history").fetchone()[0]
            in_pgq = conn.execute("select count(*) from pgq.event_1").fetchone()[0]
        assert history > 2000 and in_pgq > 0
        # every table stayed in state ok: nothing was copied again
        r = run_cli(str(pgc["leaf"]), "tables")
        assert r.stdout.count(" ok") == 4, r.stdout
        # Londiste and PgQ go (leaf, then root); the root keeps PgQ's API on pgcascade's queue
        stop(pgqd)
        r = run_cli(str(pgc["leaf"]), "drop-londiste")
        assert r.returncode == 0 and "dropped londiste, pgq_node, pgq" in r.stdout, r.stderr
        r = run_cli(str(pgc["root"]), "drop-londiste", "--pgq-compat")
        assert r.returncode == 0 and "dropped londiste, pgq_node, pgq" in r.stdout, r.stderr
        r = run_cli(str(pgc["root"]), "drop-londiste")  # again: the pgq schema left is pgcascade's
        assert r.returncode == 0 and "no Londiste or PgQ here" in r.stdout, r.stderr
        with root.connect() as conn:
            assert (
                conn.execute("select count(*) from pg_extension where extname like 'pgq%'").fetchone()[0] == 0
            )
            assert conn.execute("select pgq.version()").fetchone()[0] == "3.5"
            conn.execute("update pgbench_accounts set abalance = abalance + 1 where aid <= 100")
        # replication goes on without them
        wait_until(
            lambda: table_checksum(root, "pgbench_accounts") == table_checksum(leaf, "pgbench_accounts"),
            60,
            what="the leaf to apply a change made after Londiste was dropped",
        )
    finally:
        for p in (worker, pgqd):
            stop(p)
