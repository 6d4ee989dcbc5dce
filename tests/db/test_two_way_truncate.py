"""Two-way TRUNCATE's bookkeeping on one master: the table-level tombstone a local TRUNCATE
leaves, and the trigger that records it, which an upgrade adds to tables made two-way before."""

from __future__ import annotations

from pgcascade.core import schema

TRIGGER = "_pgcascade_tombstone_trunc"


def triggers(db, table: str) -> set[str]:
    with db.connect() as conn:
        return {
            r[0]
            for r in conn.execute(
                "select tgname from pg_trigger where tgrelid = %s::regclass and not tgisinternal", (table,)
            )
        }


def test_a_local_truncate_leaves_a_table_tombstone_and_an_upgrade_adds_its_trigger(db) -> None:
    with db.connect() as conn:
        conn.execute("create table t (id int primary key, v text)")
        conn.execute(
            "insert into pgcascade.set_table (queue_name, table_name, key_columns) values ('q', 'public.t', '{id}')"
        )
        conn.execute("select pgcascade.two_way_table('public.t', '{id}', true)")
    assert {TRIGGER, "_pgcascade_tombstone_key", "_pgcascade_tombstone_del"} <= triggers(db, "t")

    with db.connect() as conn:
        conn.execute("insert into t values (1, 'a'), (2, 'b')")
        conn.execute("delete from t where id = 1")  # a row tombstone, which the TRUNCATE covers
        assert conn.execute("select count(*) from pgcascade.row_version").fetchone()[0] == 1
        with conn.transaction():
            conn.execute("truncate t")
            xid = conn.execute("select pg_current_xact_id()").fetchone()[0]
        tomb = conn.execute("select table_name, origin, xid from pgcascade.table_truncate").fetchall()
        assert tomb == [("public.t", None, xid)]
        assert conn.execute("select count(*) from pgcascade.row_version").fetchone()[0] == 0
        # a peer's apply (pgcascade.origin set) records its own: the trigger leaves it alone
        with conn.transaction():
            conn.execute("select set_config('pgcascade.origin', 'b', true)")
            conn.execute("truncate t")
        assert conn.execute("select xid from pgcascade.table_truncate").fetchone()[0] == xid

    # a master made two-way before migration 17 has no TRUNCATE trigger: install adds it
    with db.connect() as conn:
        conn.execute(f"drop trigger {TRIGGER} on t")
    assert TRIGGER not in triggers(db, "t")
    with db.connect() as conn:
        schema.install(conn)
    assert TRIGGER in triggers(db, "t")
    # and back to one-way: every tombstone trigger goes
    with db.connect() as conn:
        conn.execute("select pgcascade.two_way_table('public.t', '{id}', false)")
    assert not {TRIGGER, "_pgcascade_tombstone_key", "_pgcascade_tombstone_del"} & triggers(db, "t")
