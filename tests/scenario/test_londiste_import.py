"""Moving a live Londiste 3 set to pgcascade without copying again (import-londiste), with the
real Londiste 3, PgQ and pgqd from Debian.  pgbench writes on the root throughout: the root is
imported, the leaf's Londiste worker applies the last PgQ tick and stops, the leaf is imported,
and pgcascade's worker continues.  The leaf ends equal to the root (md5 of every row, computed
by PostgreSQL), with every history row once (pgbench_history has a primary key).  Then the way
back under writes (back-to-londiste: root, leaf, root), Londiste replicating again with no
copy, and the import again, after which Londiste and PgQ are dropped.  The leaf's Londiste ini
writes its pidfile as Skytools inis do (`~/pid/%(job_name)s.pid`, job_name from the file's
name): import-londiste finds the running worker there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from conftest import Daemons, run_cli, table_checksum
from test_replication import PGBENCH_TABLES, pgbench, pgbench_init

from pgcascade.dev.localcluster import wait_until

QUEUE = "lq"
LONDISTE = ["/usr/bin/python3", "/usr/bin/londiste"]  # Debian's, on the system Python (psycopg2)
ENV = dict(os.environ)  # HOME is the test's directory (set in the test): `~` in the Londiste ini


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return run_cli(*map(str, args), env=ENV)


def write_ini(path: Path, section: str, **keys: object) -> Path:
    path.write_text(f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))
    return path


def londiste(ini: Path, *args: str) -> str:
    r = subprocess.run([*LONDISTE, str(ini), *args], capture_output=True, text=True, timeout=120, env=ENV)
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


def londiste_worker(ini: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*LONDISTE, str(ini), "worker"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV
    )


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
    ENV["HOME"] = str(tmp_path)
    (tmp_path / "pid").mkdir()
    l_leaf = write_ini(  # job_name: the file's name, as Skytools has it
        tmp_path / "l_leaf.ini",
        "londiste",
        db=leaf.connstr,
        queue_name=QUEUE,
        logfile="~/%(job_name)s.log",
        pidfile="~/pid/%(job_name)s.pid",
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
    worker = londiste_worker(l_leaf)
    try:
        load = pgbench(root, "-c", "2", "-j", "2", "-T", "25", "-R", "120")
        wait_until(
            lambda: leaf.scalar("select count(*) from pgbench_history") > 0, 60, what="Londiste to apply"
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
        r = cli(pgc["root"], "import-londiste", l_root, "--dry-run")
        assert r.returncode == 0 and "node root (root) of queue lq becomes a pgcascade root" in r.stdout, r
        r = cli(pgc["root"], "import-londiste", l_root)
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
        root_worker = daemons.start(str(pgc["root"]), "worker")

        # the leaf's Londiste worker still runs: the import finds its pidfile and refuses
        r = cli(pgc["leaf"], "import-londiste", l_leaf)
        assert r.returncode == 2, r.stderr
        assert (
            f"the Londiste worker l_leaf runs (pid {worker.pid}, {tmp_path}/pid/l_leaf.pid): stop it first"
            in r.stderr
        )

        def londiste_applied() -> int:
            with leaf.connect() as conn:
                return conn.execute(
                    "select worker_last_tick from pgq_node.get_node_info(%s)", (QUEUE,)
                ).fetchone()[0]

        def import_leaf(londiste_worker: subprocess.Popen) -> subprocess.Popen:
            """Once Londiste's leaf applied the last PgQ tick: its worker stops, the leaf is imported."""
            with root.connect() as conn:
                final = conn.execute("select pgq_final_tick from pgcascade.londiste_import").fetchone()[0]
            wait_until(
                lambda: londiste_applied() >= final, 60, what="Londiste's leaf to apply the last PgQ tick"
            )
            stop(londiste_worker)
            r = cli(pgc["leaf"], "import-londiste", l_leaf)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "leaf is a pgcascade leaf of root, 4 tables" in r.stdout, r.stdout
            assert "is stopped" in r.stderr, r.stderr  # the pidfile was read
            return daemons.start(str(pgc["leaf"]), "worker")

        def leaf_applied() -> int:
            with leaf.connect() as conn:
                return conn.execute("select last_tick from pgcascade.node").fetchone()[0]

        def assert_equal() -> None:
            for t in PGBENCH_TABLES:
                assert table_checksum(root, t) == table_checksum(leaf, t), f"{t} differs"

        leaf_worker = import_leaf(worker)
        assert load.wait(timeout=90) == 0, load.stderr.read()
        with root.connect() as conn:
            target = conn.execute("select pgcascade.ticker(%s)", (QUEUE,)).fetchone()[0]
        wait_until(lambda: leaf_applied() >= target, 90, what="the leaf to apply the root's last tick")
        assert_equal()
        with root.connect() as conn:
            history = conn.execute("select count(*) from pgbench_history").fetchone()[0]
            in_pgq = conn.execute("select count(*) from pgq.event_1").fetchone()[0]
        assert history > 2000 and in_pgq > 0
        # every table stayed in state ok: nothing was copied again
        r = cli(pgc["leaf"], "tables")
        assert r.stdout.count(" ok") == 4, r.stdout

        # the way back, under writes: the root first (Londiste captures again), then the leaf once
        # pgcascade's worker applied pgcascade's last tick and stopped, then the root again
        load = pgbench(root, "-c", "2", "-j", "2", "-T", "8", "-R", "120")
        time.sleep(1)
        r = cli(pgc["leaf"], "back-to-londiste")
        assert r.returncode == 2 and "run back-to-londiste on the root root first" in r.stderr, r.stderr
        r = cli(pgc["root"], "back-to-londiste")
        assert r.returncode == 0, r.stdout + r.stderr
        last = int(re.search(r"pgcascade's last tick is (\d+)", r.stdout).group(1))  # type: ignore[union-attr]
        wait_until(lambda: leaf_applied() >= last, 60, what="the leaf to apply pgcascade's last tick")
        r = cli(pgc["leaf"], "back-to-londiste")
        assert r.returncode == 2 and "stop it first" in r.stderr, r.stderr  # its pgcascade worker runs
        daemons.kill(leaf_worker, signal.SIGINT)
        r = cli(pgc["root"], "back-to-londiste")
        assert r.returncode == 2 and "leaf are still pgcascade nodes" in r.stderr, r.stderr
        r = cli(pgc["leaf"], "back-to-londiste")
        assert r.returncode == 0 and "leaf is a Londiste leaf again" in r.stdout, r.stdout + r.stderr
        worker = londiste_worker(l_leaf)
        daemons.kill(root_worker, signal.SIGINT)
        r = cli(pgc["root"], "back-to-londiste")
        assert r.returncode == 0 and "the set is Londiste's again" in r.stdout, r.stdout + r.stderr
        assert load.wait(timeout=60) == 0, load.stderr.read()
        wait_until(
            lambda: table_checksum(root, "pgbench_history") == table_checksum(leaf, "pgbench_history"),
            90,
            what="Londiste to replicate again",
        )
        assert_equal()
        for db in (root, leaf):
            assert db.scalar("select count(*) from pgcascade.node") == 0
        with leaf.connect() as conn:  # Londiste's tables, all in sync: nothing was copied
            states = conn.execute("select merge_state from londiste.get_table_list(%s)", (QUEUE,)).fetchall()
        assert states == [("ok",)] * 4, states

        # imported again: then Londiste and PgQ go (leaf, then root); the root keeps PgQ's API
        r = cli(pgc["root"], "import-londiste", l_root)
        assert r.returncode == 0, r.stdout + r.stderr
        daemons.start(str(pgc["root"]), "worker")
        import_leaf(worker)
        stop(pgqd)
        r = cli(pgc["leaf"], "drop-londiste")
        assert r.returncode == 0 and "dropped londiste, pgq_node, pgq" in r.stdout, r.stderr
        r = cli(pgc["root"], "drop-londiste", "--pgq-compat")
        assert r.returncode == 0 and "dropped londiste, pgq_node, pgq" in r.stdout, r.stderr
        r = cli(pgc["root"], "drop-londiste")  # again: the pgq schema left is pgcascade's
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
        assert_equal()
    finally:
        for p in (worker, pgqd):
            stop(p)
