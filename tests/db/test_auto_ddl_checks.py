"""auto-ddl as a DBA meets it (docs/ddl.md): what it refuses and why, with nothing of the refused
transaction left; the privileges it needs; the verb on nodes where it does not belong; what
`status` and `tables` say; and logical capture, where the DDL travels through the WAL."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from conftest import run_cli, table_checksum
from test_replication_cli import one_line, run

from pgcascade.dev.localcluster import wait_until

# statement -> a words of the refusal.  Each is refused in its own transaction, whole.
REFUSED = {
    "alter table t add column c timestamptz default now()": "default of new column c of public.t (now())",
    "alter table t add column c serial": "is not immutable",
    "alter table t add column c int generated always as identity": "new identity column c",
    "alter table t rename to t2": "renaming it or moving it to another schema",
    "alter table t set schema other": "renaming it or moving it to another schema",
    "alter table t rename column id to key": "column id of public.t would be renamed key",
    "alter table t drop constraint t_pkey": "no unique index is left on its key (id)",
    "alter table t set unlogged": "would be UNLOGGED",
    "alter table t disable trigger all": "disable pgcascade's triggers on public.t",
    "drop trigger _pgcascade_capture_ins on t": "drops pgcascade's trigger _pgcascade_capture_ins",
    "alter table t owner to postgres, add column c int": "mixes changes that are replicated",
    "insert into t values (99, 'x'); alter table t add column c int": "not the only statement of the query",
    "do $$ begin execute 'alter table t add column c int'; end $$": "not the only statement of the query",
    "create table n as select 1 as id": "CREATE TABLE AS makes public.n from a query",
    "select 1 as id into n": "SELECT INTO makes public.n from a query",
    "create table n (id int)": "new table public.n has no primary key",
    "drop schema other cascade": "drops replicated table other.u along with it",
    "drop function pgcascade.version()": "pgcascade's own objects change only through pgcascade",
    "create table pgcascade.mine (id int primary key)": "pgcascade's own objects",
}


def catalog_state(db) -> tuple:
    """What a refused statement must not have changed: columns, indexes, triggers, events, tables."""
    with db.connect() as conn:
        return (
            conn.execute(
                "select attrelid::regclass::text, attname, atttypid, attnotnull from pg_attribute"
                " where attrelid in ('t'::regclass, 'other.u'::regclass) and attnum > 0 and not attisdropped"
                " order by 1, 2"
            ).fetchall(),
            conn.execute(
                "select indexrelid::regclass::text from pg_index where indrelid = 't'::regclass order by 1"
            ).fetchall(),
            conn.execute(
                "select tgname, tgenabled from pg_trigger where tgrelid = 't'::regclass order by 1"
            ).fetchall(),
            conn.execute("select count(*), max(ev_id) from pgcascade.event").fetchone(),
            conn.execute("select count(*) from t").fetchone(),
            conn.execute("select count(*) from pg_class where relname in ('n', 't2', 'mine')").fetchone(),
        )


def test_refused_ddl_says_why_and_how_and_leaves_nothing(replica) -> None:
    run(
        replica.root,
        "create table t (id int primary key, v text)",
        "insert into t values (1, 'a')",
        "create schema other",
        "create table other.u (id int primary key)",
    )
    replica.run("root", "create-root", "root")
    replica.run("root", "add-table", "t", "other.u")
    replica.cli("root", "auto-ddl", "on", "--add-new-tables")
    before = catalog_state(replica.root)
    for statement, words in REFUSED.items():
        with replica.root.connect() as conn, pytest.raises(psycopg.Error) as refused:
            conn.execute(statement)
        e = refused.value
        assert e.sqlstate == "0A000", (statement, e)
        assert e.diag.message_primary.startswith("pgcascade auto-ddl: "), (statement, e)
        assert words in e.diag.message_primary, (statement, e.diag.message_primary)
        assert e.diag.message_hint, f"{statement}: no hint says how to run it"
        assert catalog_state(replica.root) == before, f"{statement} left something behind"
    # the refusals that `execute` can carry out say so
    with replica.root.connect() as conn, pytest.raises(psycopg.Error) as refused:
        conn.execute("alter table t add column a int; alter table t add column b int")
    assert "pgcascade CONF execute FILE" in refused.value.diag.message_hint
    # what it does not capture it lets be: temporary and unlogged tables, a session that opts out
    run(replica.root, "create temp table scratch (id int)", "create unlogged table cache (id int)")
    with replica.root.connect() as conn:
        conn.execute("set pgcascade.auto_ddl = off")
        conn.execute("create table local_only (id int)")  # no key, in public: allowed when off
        conn.execute("alter table t add column local_col int")
    assert catalog_state(replica.root)[3] == before[3], "DDL of a session with auto_ddl off was queued"


def test_a_two_way_master_also_refuses_key_type_changes_and_renames(make_db, write_config) -> None:
    inis = {}
    for name in ("a", "b"):
        db = make_db(name)
        run(db, "create table acc (id int primary key, note text)")
        inis[name] = (write_config(name, db=db.connstr, queue_name=f"tw_{name}"), db)
        assert run_cli(inis[name][0], "create-root", name).returncode == 0
        assert run_cli(inis[name][0], "add-table", "acc").returncode == 0
    for me, other in (("a", "b"), ("b", "a")):
        r = run_cli(inis[me][0], "add-peer", other, "--location", inis[other][1].connstr)
        assert r.returncode == 0, r.stderr
    assert run_cli(inis["a"][0], "auto-ddl", "on").returncode == 0
    a = inis["a"][1]
    with a.connect() as conn, pytest.raises(psycopg.Error) as refused:
        conn.execute("alter table acc rename column note to memo")
    assert "a peer's changes made before it sees the rename" in refused.value.diag.message_primary
    assert "execute" in refused.value.diag.message_hint
    # a key's type: PostgreSQL refuses it first here (the tombstone trigger depends on the key)
    with a.connect() as conn, pytest.raises(psycopg.errors.FeatureNotSupported):
        conn.execute("alter table acc alter column id type bigint")
    run(
        a, "alter table acc alter column note type varchar(200)", "alter table acc add column n int default 1"
    )
    assert a.scalar("select count(*) from pgcascade.event where ev_type = 'EXECUTE'") == 2


def test_auto_ddl_needs_a_superuser_once(make_db, write_config) -> None:
    db = make_db("a")
    role = f"pgc_{uuid.uuid4().hex[:8]}"
    run(
        db,
        f'create role "{role}" login',
        f'grant create on database "{db.name}" to "{role}"',
        f'grant create on schema public to "{role}"',
    )
    as_role = db.connstr.replace("user=postgres", f"user={role}")
    try:
        with psycopg.connect(as_role, autocommit=True) as conn:
            conn.execute("create table t (id int primary key)")
        ini = write_config("r", db=as_role, queue_name="q")
        for args in (("create-root", "r"), ("add-table", "t")):
            assert run_cli(ini, *args).returncode == 0
        line = one_line(run_cli(ini, "auto-ddl", "on"))
        assert "needs a superuser" in line and "rds_superuser" in line and "`execute`" in line, line
        # a superuser makes the event triggers once; then pgcascade's own role switches it
        assert run_cli(write_config("su", db=db.connstr, queue_name="q"), "auto-ddl", "on").returncode == 0
        off = run_cli(ini, "auto-ddl", "off")
        assert off.returncode == 0 and "the event triggers stay" in off.stderr, off.stderr
        assert run_cli(ini, "auto-ddl", "on").returncode == 0
        with psycopg.connect(as_role, autocommit=True) as conn:
            conn.execute("alter table t add column c int")
        assert db.scalar("select count(*) from pgcascade.event where ev_type = 'EXECUTE'") == 1
    finally:
        drops = [
            f"drop event trigger if exists {t}"
            for t in ("pgcascade_ddl_start", "pgcascade_ddl_end", "pgcascade_ddl_drop")
        ]
        run(db, *drops, f'drop owned by "{role}"', f'drop role "{role}"')


def test_logical_capture_carries_ddl_through_the_wal(replica) -> None:
    """A root with logical capture: the DDL is a transactional WAL message, in order with the
    rows of its transaction; a new table joins the publication in that transaction."""
    r = replica
    run(
        r.root,
        "create table t (id int primary key, v text)",
        "insert into t select i, 'v' from generate_series(1, 20) i",
    )
    r.run("root", "create-root", "root", "--capture=logical")
    r.run("root", "add-table", "t")
    r.cli("root", "auto-ddl", "on", "--add-new-tables")
    r.run("leaf", "create-leaf", "leaf1", "--provider", r.root.connstr)
    r.cli("leaf", "add-table", "--all", "--create-full")
    assert "is for a root or a two-way master" in one_line(r.cli("leaf", "auto-ddl", "on", check=False))
    assert "auto-ddl: on, new tables in the set's schemas added" in r.cli("root", "status").stdout
    root_report = json.loads(r.cli("root", "status", "--json").stdout)
    assert root_report["auto_ddl"] == {"on": True, "add_new_tables": True, "event_triggers": True}
    assert json.loads(r.cli("leaf", "status", "--json").stdout)["takes_new_tables"] is True
    r.daemons.start(str(r.root_ini), "capture")
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    with r.root.connect(autocommit=False) as conn:
        conn.execute("insert into t values (21, 'before')")
        conn.execute("alter table t add column w int not null default 4")
        conn.execute("update t set w = id where id > 15")
        conn.execute("create table n (id int primary key, t_id int references t)")
        conn.execute("insert into n select i, i from generate_series(1, 5) i")
        conn.commit()
    run(r.root, "create table gone (id int primary key)", "insert into gone values (1)", "drop table gone")
    r.wait_sync()
    wait_until(lambda: r.leaf.scalar("select to_regclass('n') is not null"), 30, what="n on the leaf")
    for table in ("t", "n"):
        assert table_checksum(r.leaf, table) == table_checksum(r.root, table), table
    assert r.leaf.scalar("select sum(w) from t") == r.root.scalar("select sum(w) from t")
    assert r.leaf.scalar("select to_regclass('gone') is null")
    assert r.cli("leaf", "tables").stdout.split() == ["public.n", "ok", "public.t", "ok"]
