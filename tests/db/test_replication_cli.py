"""The replication verbs as a user runs them: sequences, table states, missing, remove-table,
resync, the add-table options, refusals, `execute`, the seed's Londiste 2 commands, and
what every usage error looks like (one line on stderr, exit code 2, no traceback).

Real clusters, the CLI and the daemons as processes; tables are compared with a checksum
PostgreSQL computes over every row on each side.
"""

from __future__ import annotations

import signal
import subprocess

import psycopg
import pytest
from conftest import run_cli, table_checksum

from pgcascade.dev.localcluster import wait_until


def run(db, *statements: str) -> None:
    with db.connect() as conn:
        for s in statements:
            conn.execute(s)


def one_line(r: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The single line a refused command printed on stderr (and its exit code)."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == code, f"exit {r.returncode}: {r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {r.stderr!r}"
    assert lines[0].startswith("pgcascade: "), lines[0]
    return lines[0]


def make_tables(db, *names: str, rows: int = 50) -> None:
    for n in names:
        run(
            db,
            f"create table {n} (id int primary key, v text, n int)",
            f"insert into {n} select i, 'v' || i, i from generate_series(1, {rows}) i",
        )


def leaf_states(replica) -> dict[str, str]:
    out = replica.cli("leaf", "tables").stdout
    return {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.strip()}


def change_rows(db, table: str, salt: str) -> None:
    """Updates, deletes and inserts (of ids depending on `salt`) in one table."""
    base = 1000 * (1 + ord(salt[0]) % 50)
    with db.connect() as conn:
        conn.execute(f"update {table} set v = v || '{salt}' where id % 4 = 0")
        conn.execute(f"delete from {table} where id % 7 = 0")
        conn.execute(f"insert into {table} select i, '{salt}', i from generate_series({base}, {base + 10}) i")


# --- sequences ---------------------------------------------------------------------------------------


def test_sequences_follow_the_root(replica):
    for db in (replica.root, replica.leaf):
        run(db, "create sequence public.s1", 'create sequence public."Odd Seq" start 100')
    replica.setup()
    assert replica.cli("root", "add-seq", "s1", '"Odd Seq"').stdout.split() == [
        "added",
        "public.s1",
        "added",
        'public."Odd',
        'Seq"',
    ]
    replica.cli("leaf", "add-seq", "public.s1", 'public."Odd Seq"')
    assert replica.cli("root", "seqs").stdout.splitlines() == ['public."Odd Seq"', "public.s1"]
    assert replica.cli("leaf", "seqs").stdout.splitlines() == ['public."Odd Seq"', "public.s1"]
    replica.start_ticker()
    replica.start_worker()
    run(replica.root, "select nextval('public.s1') from generate_series(1, 500)")
    run(replica.root, "select nextval('public.\"Odd Seq\"') from generate_series(1, 7)")
    replica.wait_sync()

    def last(db, seq: str) -> int | None:
        return db.scalar("select pg_sequence_last_value(%s::regclass)", (seq,))

    assert last(replica.root, "public.s1") == 500
    assert last(replica.leaf, "public.s1") >= 500
    assert last(replica.leaf, 'public."Odd Seq"') >= last(replica.root, 'public."Odd Seq"') == 106
    # the leaf's next value is past every value the root handed out
    assert replica.leaf.scalar("select nextval('public.s1')") > 500

    # remove-seq: the leaf stops following, the root stops listing
    assert replica.cli("leaf", "remove-seq", "s1").stdout.strip() == "removed s1"
    assert replica.cli("leaf", "seqs").stdout.splitlines() == ['public."Odd Seq"']
    before = last(replica.leaf, "public.s1")
    run(replica.root, "select nextval('public.s1') from generate_series(1, 1000)")
    replica.wait_sync()
    assert last(replica.leaf, "public.s1") == before
    replica.cli("root", "remove-seq", "public.s1")
    assert replica.cli("root", "seqs").stdout.splitlines() == ['public."Odd Seq"']
    one_line(replica.cli("root", "remove-seq", "public.s1", check=False))
    one_line(replica.cli("leaf", "add-seq", "public.s1", check=False))  # not in the set any more


# --- tables, missing, remove-table, resync, local writes ---------------------------------------------


def test_tables_missing_remove_resync_and_local_writes(replica):
    make_tables(replica.root, "public.t1", "public.t2", "public.t3")
    replica.setup()
    replica.cli("root", "add-table", "public.t1", "public.t2", "public.t3")
    assert replica.cli("root", "tables").stdout.splitlines() == [
        "public.t1  key: id",
        "public.t2  key: id",
        "public.t3  key: id",
    ]
    replica.cli("leaf", "add-table", "t1", "t2", "--create")
    assert replica.cli("leaf", "missing").stdout.splitlines() == ["public.t3"]
    one_line(replica.cli("root", "missing", check=False))  # a subscriber verb
    assert leaf_states(replica) == {"public.t1": "NULL", "public.t2": "NULL"}
    replica.cli("leaf", "add-table", "t3", "--create", "--allow-local-writes")
    assert replica.cli("leaf", "missing").stdout == ""
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    assert leaf_states(replica) == {"public.t1": "ok", "public.t2": "ok", "public.t3": "ok"}
    replica.assert_equal("public.t1", "public.t2", "public.t3")

    # ordinary sessions may not write to a replicated table: one line that says why
    with replica.leaf.connect() as conn:
        for stmt in ("insert into public.t1 values (-1, 'local', 0)", "truncate public.t2"):
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as e:
                conn.execute(stmt)
            msg = e.value.diag.message_primary
            assert "replicated by pgcascade" in msg and "\n" not in msg, msg
        # ... except into the table added with --allow-local-writes
        conn.execute("insert into public.t3 values (-1, 'local', 0)")
        assert conn.execute("select v from public.t3 where id = -1").fetchone() == ("local",)
        conn.execute("delete from public.t3 where id = -1")

    # tamper with t1 behind replication's back; resync copies it again
    with replica.leaf.connect() as conn:
        conn.execute("set session_replication_role = replica")
        conn.execute("delete from public.t1 where id < 10")
        conn.execute("update public.t1 set v = 'tampered' where id > 40")
        conn.execute("insert into public.t1 values (-5, 'extra', 0)")
    assert table_checksum(replica.root, "public.t1") != table_checksum(replica.leaf, "public.t1")
    change_rows(replica.root, "public.t1", "a")
    assert replica.cli("leaf", "resync", "t1").stdout.strip() == "resync public.t1"
    replica.wait_sync()
    replica.assert_equal("public.t1", "public.t2", "public.t3")
    assert replica.log("leaf").count("public.t1: starting initial copy") == 2

    # remove-table: the table stays with its rows, events are not applied, local writes work
    assert replica.cli("leaf", "remove-table", "public.t2").stdout.strip() == "removed public.t2"
    assert set(leaf_states(replica)) == {"public.t1", "public.t3"}
    assert replica.cli("leaf", "missing").stdout.splitlines() == ["public.t2"]
    kept = table_checksum(replica.leaf, "public.t2")
    assert kept == table_checksum(replica.root, "public.t2")
    change_rows(replica.root, "public.t2", "b")
    change_rows(replica.root, "public.t1", "b")
    replica.wait_sync()
    replica.assert_equal("public.t1", "public.t3")
    assert table_checksum(replica.leaf, "public.t2") == kept != table_checksum(replica.root, "public.t2")
    run(replica.leaf, "insert into public.t2 values (-1, 'local now', 0)")
    one_line(replica.cli("leaf", "remove-table", "public.t2", check=False))
    one_line(replica.cli("leaf", "resync", "public.t2", check=False))
    one_line(replica.cli("root", "resync", "public.t1", check=False))


def test_expect_sync_skips_the_copy_and_skip_truncate_keeps_rows(replica):
    make_tables(replica.root, "public.same", "public.keep", rows=30)
    # same: already equal on the leaf; keep: the leaf has rows of its own (ids 5000+)
    make_tables(replica.leaf, "public.same", rows=30)
    run(
        replica.leaf,
        "create table public.keep (id int primary key, v text, n int)",
        "insert into public.keep select i, 'leaf only', i from generate_series(5000, 5009) i",
    )
    replica.setup()
    replica.cli("root", "add-table", "public.same", "public.keep")
    replica.cli("leaf", "add-table", "public.same", "--expect-sync")
    replica.cli("leaf", "add-table", "public.keep", "--skip-truncate")
    assert leaf_states(replica) == {"public.keep": "NULL", "public.same": "ok"}  # ok at once
    replica.start_ticker()
    replica.start_worker()
    change_rows(replica.root, "public.same", "x")
    change_rows(replica.root, "public.keep", "x")
    replica.wait_sync()
    replica.assert_equal("public.same")
    log = replica.log("leaf")
    assert "public.same: starting initial copy" not in log
    assert "public.keep: starting initial copy" in log
    assert replica.leaf.scalar("select count(*) from public.keep where id between 5000 and 5009") == 10
    with replica.leaf.connect() as conn:
        conn.execute("set session_replication_role = replica")
        conn.execute("delete from public.keep where id between 5000 and 5009")
    replica.assert_equal("public.keep")


def copy_consumers(replica) -> list[str]:
    with replica.root.connect() as conn:
        rows = conn.execute(
            "select consumer_name from pgcascade.get_consumer_info(%s) where consumer_name like '%%.copy.%%'",
            (replica.queue,),
        ).fetchall()
    return sorted(r[0] for r in rows)


def test_a_copy_consumer_left_on_the_provider_is_dropped_by_the_worker(replica):
    """A copy whose provider went away as it finished could leave its consumer registered (a
    release before this one did): it held the root's ticks and events back for ever.  The
    worker drops such consumers of tables no copy is at work on; a copy at work keeps its own."""
    make_tables(replica.root, "public.done", "public.copying")
    replica.setup(["public.done"])
    replica.start_ticker()
    worker = replica.start_worker()
    replica.wait_sync()
    replica.daemons.kill(worker)
    replica.cli("root", "add-table", "public.copying")
    replica.cli("leaf", "add-table", "public.copying", "--create")
    # a copy at work on public.copying: its state says so; public.done's copy is long over
    run(
        replica.leaf,
        "update pgcascade.subscriber_table set state = 'wanna-sync:999999999' where table_name = 'public.copying'",
    )
    for t in ("public.done", "public.copying"):
        run(replica.root, f"select pgcascade.register_consumer('{replica.queue}', 'leaf1.copy.{t}')")
    assert copy_consumers(replica) == ["leaf1.copy.public.copying", "leaf1.copy.public.done"]
    replica.start_worker()
    wait_until(
        lambda: copy_consumers(replica) == ["leaf1.copy.public.copying"], 30, what="the left consumer gone"
    )
    assert "unregistering leaf1.copy.public.done: no copy of its table is at work" in replica.log("leaf")


# --- refusals ------------------------------------------------------------------------------------------


def test_refusals_no_key_not_in_set_structure_mismatch(replica):
    run(
        replica.root,
        "create table public.nopk (a int not null, b text)",
        "create table public.nullable (a int, b text)",
        "create table public.typed (id int primary key, v int4, w text)",
        "create table public.notinset (id int primary key)",
        "insert into public.nopk select i, 'b' from generate_series(1, 20) i",
        "insert into public.typed select i, i, 'w' from generate_series(1, 20) i",
    )
    run(
        replica.leaf,
        "create table public.nopk (a int not null, b text)",
        "create table public.typed (id int primary key, v int8, w text)",
        "create table public.notinset (id int primary key)",
    )
    replica.setup()
    line = one_line(replica.cli("root", "add-table", "public.nopk", check=False))
    assert "no primary key" in line and "--key" in line
    line = one_line(replica.cli("root", "add-table", "public.nullable", "--key=a", check=False))
    assert '"a"' in line and "nullable" in line
    one_line(replica.cli("root", "add-table", "public.nopk", "--key=nosuchcol", check=False))
    assert replica.cli("root", "add-table", "public.nopk", "--key=a").stdout.strip() == "added public.nopk"
    replica.cli("root", "add-table", "public.typed")

    line = one_line(replica.cli("leaf", "add-table", "public.notinset", check=False))
    assert "public.notinset" in line and "not replicated by the provider" in line
    line = one_line(replica.cli("leaf", "add-table", "public.typed", check=False))
    assert '"v"' in line and "integer" in line and "bigint" in line and "--force" in line
    assert leaf_states(replica) == {}  # nothing half-added
    replica.cli("leaf", "add-table", "public.typed", "public.nopk", "--force")
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    run(
        replica.root,
        "update public.typed set v = v * 1000000, w = 'x' where id % 3 = 0",
        "insert into public.typed select i, -i, 'new' from generate_series(100, 110) i",
        "delete from public.typed where id % 5 = 0",
    )
    run(
        replica.root,
        "update public.nopk set b = 'changed' where a < 5",
        "delete from public.nopk where a > 15",
    )
    replica.wait_sync()
    replica.assert_equal("public.typed", "public.nopk")


# --- execute -------------------------------------------------------------------------------------------


def test_execute_applies_ddl_at_the_same_position(replica, tmp_path):
    make_tables(replica.root, "public.t", "public.ts", rows=20)
    replica.setup()
    replica.cli("root", "add-table", "public.t")
    replica.cli("root", "add-table", "public.ts", "--format=sql")  # the seed's partial SQL events
    replica.cli("leaf", "add-table", "public.t", "public.ts", "--create")
    replica.start_ticker()
    worker = replica.start_worker()
    replica.wait_sync()
    tables = ("public.t", "public.ts")

    ddl1 = tmp_path / "add_column.sql"
    ddl1.write_text(
        "".join(
            f"alter table {t} add column extra int not null default 42;\n"
            f"create index {t.split('.')[1]}_extra on {t} (extra);\n"
            for t in tables
        )
    )
    for t in tables:
        run(replica.root, f"insert into {t} values (100, 'before the ddl', 0)")
    assert replica.cli("root", "execute", str(ddl1)).stdout.strip() == f"executed {ddl1}"
    for t in tables:
        run(
            replica.root,
            f"insert into {t} values (101, 'after the ddl', 1, 7)",
            f"update {t} set extra = id where id < 5",
        )
    replica.wait_sync()
    replica.assert_equal(*tables)
    for t in tables:
        assert replica.leaf.scalar(f"select extra from {t} where id = 101") == 7
        assert replica.leaf.scalar(f"select to_regclass('{t}_extra') is not null")

    # the DDL and rows that use it in one batch: the worker is stopped meanwhile
    replica.daemons.kill(worker, signal.SIGINT)
    ddl2 = tmp_path / "add_column_2.sql"
    ddl2.write_text("".join(f"alter table {t} add column label text default 'none';\n" for t in tables))
    for t in tables:
        run(replica.root, f"update {t} set v = 'before ddl2' where id = 1")
    replica.cli("root", "execute", str(ddl2))
    for t in tables:
        run(
            replica.root,
            f"insert into {t} values (102, 'after ddl2', 2, 8, 'labelled')",
            f"update {t} set label = 'set ' || id where id between 2 and 4",
        )
    replica.start_worker()
    replica.wait_sync()
    replica.assert_equal(*tables)
    for t in tables:
        assert replica.leaf.scalar(f"select label from {t} where id = 102") == "labelled"

    # a script that fails on the root changes nothing anywhere
    bad = tmp_path / "bad.sql"
    bad.write_text("alter table public.t add column broken int;\nselect 1/0;\n")
    r = replica.cli("root", "execute", str(bad), check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    replica.wait_sync()
    for db in (replica.root, replica.leaf):
        assert (
            db.scalar(
                "select count(*) from pg_attribute where attrelid = 'public.t'::regclass and attname = 'broken'"
            )
            == 0
        )

    line = one_line(replica.cli("leaf", "execute", str(ddl1), check=False))
    assert "root" in line


# --- Londiste 2 (seed 000) commands ---------------------------------------------------------------------


def londiste_ini(replica, queue: str = "londiste_q", job: str = "sub1") -> str:
    path = replica.tmp / "londiste.ini"
    path.write_text(
        "[londiste]\n"
        f"job_name = {job}\n"
        f"provider_db = {replica.root.connstr}\n"
        f"subscriber_db = {replica.leaf.connstr}\n"
        f"pgq_queue_name = {queue}\n"
        f"logfile = {replica.tmp}/%(job_name)s.log\n"
        f"pidfile = {replica.tmp}/%(job_name)s.pid\n"
    )
    return str(path)


def test_londiste2_commands_end_to_end(replica):
    ini = londiste_ini(replica)

    def lcli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = run_cli(ini, *args)
        if check:
            assert r.returncode == 0, f"{' '.join(args)}: {r.stderr}"
        return r

    make_tables(replica.root, "public.orders", "public.items", "public.notes")
    run(replica.root, "create sequence public.order_seq")
    run(replica.leaf, "create sequence public.order_seq")
    for t in ("public.orders", "public.items"):
        run(replica.leaf, f"create table {t} (id int primary key, v text, n int)")
    make_tables(replica.leaf, "public.notes")  # in sync already

    one_line(lcli("provider", "add", "public.orders", check=False))  # not installed yet
    assert lcli("provider", "install").stdout.strip() == "provider of londiste_q: installed"
    assert lcli("provider", "install").stdout.strip() == "provider of londiste_q: installed already"
    assert lcli("provider", "add", "public.orders", "items").stdout.split() == [
        "added",
        "public.orders",
        "added",
        "public.items",
    ]
    lcli("provider", "add", "public.notes", "--format=sql")
    assert lcli("provider", "tables").stdout.splitlines() == ["public.items", "public.notes", "public.orders"]
    one_line(lcli("subscriber", "add", "public.orders", check=False))  # no subscriber node yet
    assert lcli("subscriber", "install").stdout.strip() == "subscriber sub1 of londiste_q: installed"
    lcli("subscriber", "add", "public.orders", "public.items")
    lcli("subscriber", "add", "public.notes", "--expect-sync")
    # the generic verbs work on a Londiste 2 config too: sequences, states, wait-sync
    root_cfg = replica.ini("rootcfg", replica.root)
    root_cfg.write_text(root_cfg.read_text().replace("queue_name = rep", "queue_name = londiste_q"))
    assert run_cli(root_cfg, "add-seq", "public.order_seq").returncode == 0
    assert lcli("provider", "seqs").stdout.splitlines() == ["public.order_seq"]
    lcli("add-seq", "public.order_seq")
    assert "public.notes  ok" in lcli("tables").stdout

    replica.start_ticker()
    replica.daemons.start(ini, "replay")
    with replica.root.connect() as conn:
        for t in ("public.orders", "public.items", "public.notes"):
            conn.execute(f"update {t} set v = 'changed' where id % 3 = 0")
            conn.execute(
                f"insert into {t} select i, 'new', nextval('public.order_seq') from generate_series(100, 120) i"
            )
            conn.execute(f"delete from {t} where id % 10 = 1")
    lcli("wait-sync", "--timeout", "60")
    replica.assert_equal("public.orders", "public.items", "public.notes")
    assert replica.leaf.scalar("select pg_sequence_last_value('public.order_seq')") >= 63

    # resync after tampering, remove on both sides
    with replica.leaf.connect() as conn:
        conn.execute("set session_replication_role = replica")
        conn.execute("delete from public.items")
    assert lcli("subscriber", "resync", "public.items").stdout.strip() == "resync public.items"
    lcli("wait-sync", "--timeout", "60")
    replica.assert_equal("public.items")
    assert lcli("subscriber", "remove", "public.items").stdout.strip() == "removed public.items"
    assert lcli("provider", "remove", "public.items").stdout.strip() == "removed public.items"
    assert lcli("provider", "tables").stdout.splitlines() == ["public.notes", "public.orders"]
    run(replica.root, "insert into public.orders values (5000, 'last', 0)")
    lcli("wait-sync", "--timeout", "60")
    replica.assert_equal("public.orders", "public.notes")
    assert "worker sub1 starting" in (replica.tmp / "sub1.log").read_text()

    # replay -s stops the daemon through its pidfile
    assert "stop sent" in lcli("replay", "-s").stdout


# --- usage errors -----------------------------------------------------------------------------------------


def test_usage_errors_exit_2_with_one_line(replica, tmp_path):
    make_tables(replica.root, "public.a", "public.b", rows=3)
    make_tables(replica.leaf, "public.a", "public.b", rows=3)

    # verbs before the node exists
    for args in (("add-table", "public.a"), ("tables",), ("add-seq", "x"), ("missing",), ("worker",)):
        line = one_line(replica.cli("root", *args, check=False))
        assert "create-root" in line, line
    # a leaf whose provider is not a root of the set
    line = one_line(
        replica.cli("leaf", "create-leaf", "leaf1", "--provider", replica.root.connstr, check=False)
    )
    assert "not a root" in line
    replica.setup()

    root_cases = [
        (("add-table",), "needs table names"),
        (("add-table", "public.nosuch"), "does not exist"),
        (("add-table", "nosuch*"), "no table matches"),
        (("add-table", "a.b.c"), "invalid table name"),
        (("add-table", '"unterminated'), "invalid table name"),
        (("add-table", "public.a", "--format=xml"), "format"),
        (("remove-table", "public.a"), "not in the set"),
        (("add-seq",), "needs sequence names"),
        (("remove-seq", "nosuch"), "not in the set"),
        (("resync", "public.a"), "subscriber verb"),
        (("execute", str(tmp_path / "nosuch.sql")), "does not exist"),
        (("add-table", "--nosuchoption"), "No such option"),
        (("nosuchverb",), "No such command"),
    ]
    for args, expect in root_cases:
        line = one_line(replica.cli("root", *args, check=False))
        assert expect in line, (args, line)

    replica.cli("root", "add-table", "public.a", "public.b")
    leaf_cases = [
        (("add-table", "public.a", "public.b", "--dest-table", "other.x"), "exactly one table"),
        (("add-table", "public.nosuch"), "not replicated by the provider"),
        (("add-table", "public.a", "--key=id"), "set on the root"),
        (("add-table", "public.a", "--format=sql"), "set on the root"),
        (("add-table", "public.a", "--merge-all"), "is for a merge-leaf"),
        (("remove-table", "public.a"), "not replicated here"),
        (("resync", "public.a"), "not replicated here"),
        (("execute", str(tmp_path / "leaf.ini")), "root"),
    ]
    (tmp_path / "x.sql").write_text("select 1")
    for args, expect in leaf_cases:
        line = one_line(replica.cli("leaf", *args, check=False))
        assert expect in line, (args, line)
    line = one_line(
        replica.cli("leaf", "create-leaf", "leaf2", "--provider", replica.root.connstr, check=False)
    )
    assert "already node leaf1" in line

    # configs without what a verb needs
    noqueue = tmp_path / "noqueue.ini"
    noqueue.write_text(f"[pgcascade]\njob_name = nq\ndb = {replica.leaf.connstr}\n")
    for args in (("worker",), ("add-table", "public.a"), ("tables",), ("create-root", "r")):
        line = one_line(run_cli(noqueue, *args))
        assert "queue_name is not set" in line, line
    nodb = tmp_path / "nodb.ini"
    nodb.write_text("[pgcascade]\njob_name = nd\nqueue_name = rep\n")
    assert "db is not set" in one_line(run_cli(nodb, "worker"))
    noprov = tmp_path / "noprov.ini"
    noprov.write_text(
        f"[londiste]\njob_name = np\nsubscriber_db = {replica.leaf.connstr}\npgq_queue_name = rep\n"
    )
    for args in (("provider", "install"), ("provider", "tables"), ("subscriber", "install")):
        assert "provider_db is not set" in one_line(run_cli(noprov, *args))
