"""The trigger capture of UPDATE (sql/capture/90_capture.sql): a JSON table that is not
partitioned gets a U per new row from its statement trigger and a D of the old key from a row
trigger when a key changes; other tables join old and new rows.  Keys that swap places, shift,
or are changed by a BEFORE trigger must reach the leaf, applied set-based or row by row, and
a key column's type can still be changed."""

from __future__ import annotations

import psycopg
import pytest
from conftest import TEXT_SETTINGS, Daemons, table_checksum

from pgcascade.dev.localcluster import wait_until


def run(db, *statements: str) -> None:
    with db.connect() as conn:
        for s in statements:
            conn.execute(s)


def rows(db, query: str) -> list[tuple]:
    with db.connect() as conn:
        conn.execute(TEXT_SETTINGS)
        return conn.execute(query).fetchall()


def assert_same_rows(replica, *tables: str) -> None:
    """Row by row, not only the checksum: the message shows what differs."""
    for t in tables:
        q = f"select * from {t} order by 1, 2"
        assert rows(replica.root, q) == rows(replica.leaf, q), t
        assert table_checksum(replica.root, t) == table_checksum(replica.leaf, t), t


def capture_triggers(db, table: str) -> dict[str, bool]:
    """The table's capture triggers, each with whether it keeps an OLD transition table."""
    return dict(
        rows(
            db,
            "select tgname::text, tgoldtable is not null from pg_trigger"
            f" where tgrelid = '{table}'::regclass and tgname like '\\_pgcascade\\_capture\\_%' order by 1",
        )
    )


def key_type(db) -> str:
    """The type of column id of table a."""
    return db.scalar(
        "select format_type(atttypid, atttypmod) from pg_attribute where attrelid = 'a'::regclass and attname = 'id'"
    )


def event_types(db, txid: int) -> list[str]:
    return [
        r[0] for r in rows(db, f"select ev_type from pgcascade.event where ev_txid = {txid} order by ev_id")
    ]


# a row whose v becomes 'move' gets a new key from a BEFORE trigger: its UPDATE never names the key
MOVE = """
create function move_key() returns trigger language plpgsql as $$
begin
    if new.v = 'move' then new.id := new.id + 1000; end if;
    return new;
end $$"""


def changes(conn: psycopg.Connection, t: str) -> int:
    """Key swaps, shifts and changes of every kind on table t; returns the swap's transaction id."""
    with conn.transaction():
        conn.execute(f"update {t} set id = 3 - id where id in (1, 2)")  # two keys swap places
        txid = conn.execute("select txid_current()").fetchone()[0]
    conn.execute(f"update {t} set id = id + 1 where id between 45 and 50")  # keys shift onto each other
    conn.execute(f"update {t} set v = 'move' where id in (20, 21)")  # the BEFORE trigger moves them
    conn.execute(f"update {t} set v = v || '!' where id between 30 and 40")  # values only
    with conn.transaction():  # a key and a value change in one statement, then the row again
        conn.execute(f"update {t} set id = -id, v = 'neg' where id in (41, 42)")
        conn.execute(f"update {t} set v = 'again' where id = -41")
        conn.execute(f"delete from {t} where id = -42")
        conn.execute(f"insert into {t} values (42, 'back')")
    return txid


def test_key_changes_reach_the_leaf_set_based_and_row_by_row(replica):
    # a: a deferrable primary key on the root (a swap in one statement passes there), the
    # leaf's own plain one (applied set-based); b: no unique index on either side, --key
    # (applied row by row, in event order); s: the partial-SQL format; p: partitioned
    root_ddl = [
        "create table a (id int primary key deferrable, v text)",
        "create table b (id int not null, v text)",
        "create table s (id int primary key deferrable, v text)",
        "create table p (id int primary key deferrable, v text) partition by range (id)",
        "create table p_all partition of p for values from (-100000) to (100000)",
        MOVE,
    ]
    run(replica.root, *root_ddl)
    for t in ("a", "b", "s", "p"):
        run(
            replica.root,
            f"insert into {t} select i, 'v' || i from generate_series(1, 50) i",
            f"create trigger move before update on {t} for each row execute function move_key()",
        )
    run(
        replica.leaf,
        "create table a (id int primary key, v text)",
        "create table b (id int not null, v text)",
        "create table s (id int primary key, v text)",
        "create table p (id int primary key, v text)",
    )
    replica.run("root", "create-root", "root")
    replica.run("leaf", "create-leaf", "leaf1", "--provider", replica.root.connstr)
    replica.run("root", "add-table", "a", "p")
    replica.run("root", "add-table", "b", "--key=id")
    replica.run("root", "add-table", "s", "--format=sql")
    replica.run("leaf", "add-table", "a", "b", "s", "p")
    assert capture_triggers(replica.root, "a") == {
        "_pgcascade_capture_del": True,
        "_pgcascade_capture_ins": False,
        "_pgcascade_capture_key": False,
        "_pgcascade_capture_trunc": False,
        "_pgcascade_capture_upd": False,  # its NEW TABLE alone
    }
    for joined in ("s", "p"):
        found = capture_triggers(replica.root, joined)
        assert "_pgcascade_capture_key" not in found and found["_pgcascade_capture_upd"], joined
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()

    with replica.root.connect() as conn:
        swaps = {t: changes(conn, t) for t in ("a", "b", "s", "p")}
    assert event_types(replica.root, swaps["a"]) == ["D", "D", "U", "U"]
    assert sorted(event_types(replica.root, swaps["p"])) == ["U", "U"]  # joined on the key: updates
    replica.wait_sync()
    assert_same_rows(replica, "a", "b", "s", "p")
    for t in ("a", "b"):
        assert rows(
            replica.leaf, f"select id, v from {t} where id in (1, 2, 45, 51, 1020, 1021, -41) order by id"
        ) == [
            (-41, "again"),
            (1, "v2"),
            (2, "v1"),
            (51, "v50"),
            (1020, "move"),
            (1021, "move"),
        ], t


def key_trigger_names_the_key(db) -> bool:
    """Whether table a's key-change trigger is `UPDATE OF` its key (92_key_triggers.sql)."""
    return db.scalar(
        "select cardinality(tgattr::int2[]) > 0 from pg_trigger"
        " where tgrelid = 'a'::regclass and tgname = '_pgcascade_capture_key'"
    )


def test_a_before_trigger_made_later_takes_the_key_triggers_column_list_off(replica, tmp_path):
    # made on a table whose BEFORE trigger came after it, the key trigger would miss the keys
    # that trigger changes: the maintenance, `execute` and auto DDL each make it again
    run(replica.root, "create table a (id int primary key, v text)", MOVE)
    run(replica.root, "insert into a select i, 'v' || i from generate_series(1, 50) i")
    run(replica.leaf, MOVE)  # execute's script runs there too
    replica.setup(["a"])
    assert key_trigger_names_the_key(replica.root)
    ticker = replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    move = "create trigger {} before update on a for each row execute function move_key()"

    run(replica.root, move.format("move"))  # typed on the root: the ticker's maintenance sees it
    wait_until(lambda: not key_trigger_names_the_key(replica.root), what="the maintenance to see the trigger")
    run(replica.root, "update a set v = 'move' where id = 20")
    run(replica.root, "drop trigger move on a")
    wait_until(lambda: key_trigger_names_the_key(replica.root), what="the maintenance to see it gone")

    Daemons.kill(ticker)  # from here on no maintenance makes it again in between
    script = tmp_path / "move.sql"
    script.write_text(move.format("move") + ";\n")
    replica.cli("root", "execute", str(script))
    assert not key_trigger_names_the_key(replica.root)
    run(replica.root, "update a set v = 'move' where id = 21", "drop trigger move on a")
    run(replica.root, f"select pgcascade.maint_key_triggers('{replica.queue}')")
    assert key_trigger_names_the_key(replica.root)

    replica.run("root", "auto-ddl", "on")
    with replica.root.connect() as conn, conn.transaction():
        conn.execute(move.format("move2"))
        assert not conn.execute(
            "select cardinality(tgattr::int2[]) > 0 from pg_trigger"
            " where tgrelid = 'a'::regclass and tgname = '_pgcascade_capture_key'"
        ).fetchone()[0]
    run(replica.root, "update a set v = 'move' where id = 22")
    replica.wait_sync()
    assert_same_rows(replica, "a")
    moved = rows(replica.leaf, "select id from a where v = 'move' or id in (20, 21, 22) order by id")
    assert moved == [(1020,), (1021,), (1022,)]


def test_a_table_captured_before_keeps_the_join_until_made_again(replica):
    run(replica.root, "create table a (id int primary key deferrable, v text)")
    run(replica.root, "insert into a select i, 'v' || i from generate_series(1, 50) i")
    replica.setup(["a"])
    # the triggers a release before made: the UPDATE's with both transition tables, no key trigger
    run(
        replica.root,
        "drop trigger _pgcascade_capture_key on a",
        "drop trigger _pgcascade_capture_upd on a",
        "create trigger _pgcascade_capture_upd after update on a"
        " referencing new table as pgcascade_new old table as pgcascade_old for each statement"
        " execute function pgcascade.capture_"
        + str(replica.root.scalar("select 'a'::regclass::oid"))
        + "_upd()",
        "select pgcascade.capture_refresh('" + replica.queue + "')",  # as an upgrade does
    )
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    with replica.root.connect() as conn:
        swap = changes(conn, "a")
    assert sorted(event_types(replica.root, swap)) == ["U", "U"]  # the join: no D
    with replica.root.connect() as conn, conn.transaction():
        conn.execute("update a set id = 500 where id = 5")
        moved = conn.execute("select txid_current()").fetchone()[0]
    assert sorted(event_types(replica.root, moved)) == ["D", "I"]
    replica.wait_sync()
    assert_same_rows(replica, "a")

    # capture_enable makes the table's triggers of this release
    run(
        replica.root,
        "select pgcascade.capture_enable('" + replica.queue + "', 'a', array['id'], 'json')",
    )
    assert "_pgcascade_capture_key" in capture_triggers(replica.root, "a")
    with replica.root.connect() as conn, conn.transaction():
        conn.execute("update a set id = 600 where id = 6")
        moved = conn.execute("select txid_current()").fetchone()[0]
    assert event_types(replica.root, moved) == ["D", "U"]
    replica.wait_sync()
    assert_same_rows(replica, "a")


def test_a_key_column_type_changes_through_execute(replica, tmp_path):
    run(replica.root, "create table a (id int primary key, v text)")
    run(replica.root, "insert into a select i, 'v' || i from generate_series(1, 20) i")
    replica.setup(["a"])
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    # typed straight on the root, PostgreSQL refuses it: the key trigger's condition names the key
    with replica.root.connect() as conn, pytest.raises(psycopg.errors.FeatureNotSupported) as refused:
        conn.execute("alter table a alter column id type bigint")
    assert "_pgcascade_capture_key" in (refused.value.diag.message_detail or "")

    script = tmp_path / "widen.sql"
    script.write_text("alter table a alter column id type bigint;\n")
    out = replica.cli("root", "execute", str(script))
    assert "key-change triggers are off around it" in out.stderr + out.stdout
    assert "_pgcascade_capture_key" in capture_triggers(replica.root, "a")
    run(replica.root, "update a set id = id + 5000000000 where id = 3", "update a set v = 'x' where id = 4")
    replica.wait_sync()
    assert key_type(replica.leaf) == "bigint"
    assert_same_rows(replica, "a")
    assert replica.leaf.scalar("select count(*) from a where id = 5000000003") == 1

    # with auto-ddl, typed straight on the root: the trigger goes for the command and comes back
    replica.run("root", "auto-ddl", "on")
    run(replica.root, "alter table a alter column id type numeric(20)", "update a set id = 7000 where id = 7")
    assert "_pgcascade_capture_key" in capture_triggers(replica.root, "a")
    replica.wait_sync()
    assert key_type(replica.leaf) == "numeric(20,0)"
    assert_same_rows(replica, "a")
    # a command that fails takes the trigger's drop back with it
    with replica.root.connect() as conn, pytest.raises(psycopg.errors.DatatypeMismatch):
        conn.execute("alter table a alter column id type date")
    assert "_pgcascade_capture_key" in capture_triggers(replica.root, "a")


def test_events_name_their_table_as_the_set_does(replica):
    # the capture functions write the table's name as a literal (a `%` and quotes in it must
    # survive the two format() passes that build them), a partitioned table's from its partitions
    schema, plain, parted = '"Odd ""S"""', '"100% ""sure"""', '"p%s"'
    ddl = [
        f"create schema {schema}",
        f"create table {schema}.{plain} (id int primary key, v text)",
        f"create table {schema}.{parted} (id int primary key, v text) partition by range (id)",
        f'create table {schema}."p%s_all" partition of {schema}.{parted} for values from (0) to (1000)',
    ]
    run(replica.root, *ddl)
    run(replica.leaf, *ddl)
    tables = [f"{schema}.{plain}", f"{schema}.{parted}"]
    replica.setup(tables, leaf_args=())
    replica.start_ticker()
    replica.start_worker()
    with replica.root.connect() as conn:
        for t in tables:
            conn.execute(f"insert into {t} select i, 'v' || i from generate_series(1, 20) i")
            conn.execute(f"update {t} set v = v || '!' where id <= 10")
            conn.execute(f"update {t} set id = id + 100 where id = 11")
            conn.execute(f"delete from {t} where id between 15 and 17")
    names = [
        r[0]
        for r in rows(
            replica.root,
            "select distinct ev_extra1 from pgcascade.event where ev_type in ('I', 'U', 'D') order by 1",
        )
    ]
    assert names == sorted(tables)
    replica.wait_sync()
    assert_same_rows(replica, *tables)
    assert rows(replica.leaf, f"select count(*) from {tables[0]}") == [(17,)]
