"""Automatic DDL (docs/ddl.md): DDL run the ordinary way on a root or a two-way master, while
writes go on, reaches every node at its place in the stream.  Every node is compared outside
pgcascade: its columns and indexes from the catalog, its rows by an md5 computed by PostgreSQL."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
from conftest import Daemons, run_in_process, table_checksum
from test_replication import PGBENCH_TABLES, pgbench
from test_two_way import Master, TwoWaySet, make_tables, two_way  # noqa: F401 (a fixture)

from pgcascade.dev.localcluster import pg_bindir, wait_until


def schema_of(db, *tables: str) -> dict[str, tuple]:
    """Each table's columns (name, type, nullability, default) and index definitions."""
    with db.connect() as conn:
        out = {}
        for t in tables:
            cols = conn.execute(
                "select column_name, data_type, is_nullable, column_default from information_schema.columns"
                " where table_schema = 'public' and table_name = %s order by ordinal_position",
                (t,),
            ).fetchall()
            indexes = conn.execute(
                "select indexdef from pg_indexes where schemaname = 'public' and tablename = %s order by 1",
                (t,),
            ).fetchall()
            out[t] = (tuple(cols), tuple(i[0] for i in indexes))
        return out


def run_sql(db, *statements: str) -> None:
    """Statements sent one by one, each in its own transaction (psycopg, autocommit)."""
    with db.connect() as conn:
        for s in statements:
            conn.execute(s)


def pgbench_empty(db) -> None:
    """pgbench's tables with their keys (pgbench_history's too), and no rows yet."""
    subprocess.run(
        [str(pg_bindir() / "pgbench"), "-i", "-q", "-I", "dtp", "-n", db.connstr],
        check=True,
        capture_output=True,
    )
    run_sql(db, "alter table pgbench_history add column hid bigserial primary key")


def test_ddl_on_the_root_reaches_branch_and_leaf_under_pgbench(replica, make_db, tmp_path: Path) -> None:
    """root -> branch -> leaf: the branch carries the root's DDL events and runs them on its own
    tables (never capturing them again), the leaf under it runs them once."""
    r = replica
    branch = make_db("b")
    r.ini("branch", branch)
    pgbench_empty(r.root)
    setup = (
        ("root", "create-root", "root"),
        ("root", "add-table", *PGBENCH_TABLES),
        ("branch", "create-branch", "branch", "--provider", r.root.connstr),
        ("leaf", "create-leaf", "leaf1", "--provider", branch.connstr),
        ("branch", "add-table", "--all", "--create-full", "--expect-sync"),  # all empty
        ("leaf", "add-table", "--all", "--create-full", "--expect-sync"),
    )
    for node, *args in setup:
        done = in_process(tmp_path / f"{node}.ini", *args)
        assert done.returncode == 0, (args, done.stderr)
    said = r.cli("root", "auto-ddl", "on", "--add-new-tables").stdout
    assert "on, new tables in the set's schemas added" in said, said
    r.start_ticker()
    r.daemons.start(str(tmp_path / "branch.ini"), "worker")
    r.start_worker()
    # pgbench's rows (TRUNCATE and COPY), through the queue
    subprocess.run(
        [str(pg_bindir() / "pgbench"), "-i", "-q", "-I", "g", "-n", r.root.connstr],
        check=True,
        capture_output=True,
    )
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "10", "-R", "150")
    time.sleep(1)
    run_sql(r.root, "alter table pgbench_accounts add column note text not null default 'none'")
    run_sql(r.root, "create index concurrently history_aid on pgbench_history (aid)")
    with r.root.connect(autocommit=False) as conn:  # a new table and its rows, one transaction
        conn.execute("create table branch_notes (bid int primary key, note text, at int default 7)")
        conn.execute("insert into branch_notes (bid, note) select bid, 'first' from pgbench_branches")
        conn.commit()
    run_sql(
        r.root,
        "create table scratch (id int primary key, v text)",
        "insert into scratch select i, 'x' from generate_series(1, 50) i",
        "update pgbench_accounts set note = 'touched' where aid % 50 = 0",
        "create index on pgbench_accounts (note)",
    )
    script = tmp_path / "tellers.sql"  # `execute` still works, and runs once everywhere
    script.write_text("alter table pgbench_tellers add column remark text;\n")
    r.cli("root", "execute", str(script))
    time.sleep(1)
    run_sql(r.root, "update branch_notes set note = 'second' where bid = 1", "drop table scratch")
    assert load.wait(timeout=90) == 0, load.stderr.read()  # type: ignore[union-attr]
    r.cli("branch", "wait-sync", "--timeout", "120", timeout=150)
    r.wait_sync()

    tables = (*PGBENCH_TABLES, "branch_notes")
    for node in (branch, r.leaf):
        assert schema_of(node, *tables) == schema_of(r.root, *tables)
        for t in tables:
            assert table_checksum(node, t) == table_checksum(r.root, t), t
        assert node.scalar("select to_regclass('scratch') is null"), "the dropped table is still there"
    accounts_schema = schema_of(r.root, "pgbench_accounts")["pgbench_accounts"]
    assert any(c[0] == "note" for c in accounts_schema[0]) and any("(note)" in i for i in accounts_schema[1])
    assert any("history_aid" in i for i in schema_of(r.leaf, "pgbench_history")["pgbench_history"][1])
    assert table_checksum(r.leaf, "branch_notes")[0] == 1
    assert r.leaf.scalar("select count(*) from pgbench_accounts where note = 'touched'") > 0
    assert r.root.scalar("select to_regclass('scratch') is null")
    assert "scratch" not in in_process(tmp_path / "root.ini", "tables").stdout
    leaf_tables = in_process(tmp_path / "leaf.ini", "tables").stdout.split()
    assert (
        leaf_tables[leaf_tables.index("public.branch_notes") + 1] == "ok"
        and "public.scratch" not in leaf_tables
    )
    # the branch carried each statement once: it captured none of them again
    twice = branch.scalar(
        "select count(*) from (select ev_data from pgcascade.event where ev_type = 'EXECUTE'"
        " group by ev_data having count(*) > 1) d"
    )
    assert twice == 0 and branch.scalar("select count(*) from pgcascade.event where ev_type = 'EXECUTE'") >= 6
    log = r.log()
    assert log.count("executing auto-ddl ALTER TABLE public.pgbench_accounts") == 1
    assert log.count("executing tellers.sql") == 1


def test_ddl_on_one_master_reaches_the_others_under_writes(two_way: TwoWaySet, make_db) -> None:
    """Masters a and b write the same accounts while DDL runs on a: b's changes made before b has
    a's new column reach a and c without it; c writes into a's new table before b has applied a's
    DDL, and b applies c's changes only after it (its subscription to a paused meanwhile)."""
    a, b, c = (two_way.add_master(n, make_db(n)) for n in ("a", "b", "c"))
    for m in (a, b, c):
        make_tables(m, "accounts")
        m.run("add-table", "accounts")
    two_way.connect_all()
    for m in (a, b, c):
        assert in_process(m.ini, "auto-ddl", "on", "--add-new-tables").returncode == 0
    a.execute("insert into accounts select i, 0, null from generate_series(1, 100) i")
    two_way.start()
    two_way.wait_converged("accounts")
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=write_accounts, args=(m, i, stop, errors)) for i, m in enumerate((a, b))
    ]
    for t in threads:
        t.start()
    time.sleep(1)
    Daemons.kill(b.worker, signal.SIGINT)  # type: ignore[arg-type]  # b replays nothing for a while
    run_sql(a.db, "alter table accounts add column flag int not null default 3")
    run_sql(a.db, "create index accounts_balance on accounts (balance)")
    run_sql(
        a.db,
        "create table notes (id int primary key, account int, body text)",
        "insert into notes select i, i, 'from a' from generate_series(1, 20) i",
        "create table scratch (id int primary key)",
        "insert into scratch values (1), (2)",
    )
    wait_until(lambda: rows_of(c, "notes") == 20, 60, what="notes and its rows on c")
    run_sql(c.db, "insert into notes values (200, 2, 'from c')")
    c_tick = c.db.scalar("select pgcascade.ticker('tw_c')")  # a tick after that row
    time.sleep(1)  # b's changes without flag reach a and c
    b.execute("update pgcascade.node set paused = true where queue_name = 'tw_a'")
    two_way.start("b")
    wait_until(
        lambda: (
            "follows DDL of master a" in (two_way.tmp / "b.log").read_text()
            or b.db.scalar("select coalesce(last_tick, 0) from pgcascade.node where queue_name = 'tw_c'")
            >= c_tick
        ),
        60,
        what="b waiting for a's DDL, or past c's row",
    )
    assert rows_of(b, "notes") is None
    b.execute("update pgcascade.node set paused = false where queue_name = 'tw_a'")
    wait_until(lambda: rows_of(b, "notes") == 21, 60, what="notes and its rows on b")
    run_sql(
        b.db, "update notes set body = 'from b' where id % 2 = 0", "insert into notes values (100, 1, 'b')"
    )
    run_sql(a.db, "drop table scratch")
    time.sleep(1)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    two_way.wait_converged("accounts", "notes")
    assert (
        schema_of(a.db, "accounts", "notes")
        == schema_of(b.db, "accounts", "notes")
        == schema_of(c.db, "accounts", "notes")
    )
    assert "accounts_balance" in str(schema_of(b.db, "accounts"))
    assert a.db.scalar("select count(*) from notes where body = 'from b' or id in (100, 200)") == 12
    assert a.db.scalar("select count(*) from accounts where flag <> 3") > 0, "no write set flag"
    for m in (a, b, c):
        assert m.db.scalar("select to_regclass('scratch') is null")
        listed = in_process(m.ini, "tables").stdout
        assert "public.notes  key: id" in listed and "scratch" not in listed, listed


def in_process(ini: Path, *args: str):
    """A setup or read command, run in this process (each process costs seconds under load)."""
    return run_in_process(str(ini), *args)


def rows_of(m: Master, table: str) -> int | None:
    """The table's rows on that master, None while it does not have the table."""
    if not m.db.scalar("select to_regclass(%s) is not null", (table,)):
        return None
    return m.db.scalar(f"select count(*) from {table}")


def write_accounts(m: Master, seed: int, stop: threading.Event, errors: list[BaseException]) -> None:
    """Update random accounts (their flag too once this master has the column) until `stop`."""
    rnd = random.Random(seed)
    flag = False
    try:
        with m.db.connect() as conn:
            while not stop.is_set():
                aid, delta = rnd.randint(1, 100), rnd.randint(-50, 50)
                flag = flag or bool(
                    conn.execute(
                        "select 1 from pg_attribute where attrelid = 'accounts'::regclass and attname = 'flag'"
                    ).fetchone()
                )
                # a deadlock against the peer's apply rolls one back: an application retries
                with contextlib.suppress(psycopg.errors.DeadlockDetected):
                    if flag:
                        conn.execute(
                            "update accounts set balance = balance + %s, note = %s, flag = %s where id = %s",
                            (delta, m.name, rnd.randint(0, 9), aid),
                        )
                    else:
                        conn.execute(
                            "update accounts set balance = balance + %s, note = %s where id = %s",
                            (delta, m.name, aid),
                        )
                time.sleep(0.005)
    except psycopg.Error as e:
        errors.append(e)
