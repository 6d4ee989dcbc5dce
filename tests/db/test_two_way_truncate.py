"""Two-way TRUNCATE's bookkeeping on one master: the table-level tombstone a local TRUNCATE
leaves, and the trigger that records it, which an upgrade adds to tables made two-way before."""

from __future__ import annotations

import threading

from pgcascade.core import schema
from pgcascade.dev.localcluster import wait_until
from pgcascade.replica.peer_apply import PeerBatch
from pgcascade.replica.peer_truncate import apply_peer_truncate
from pgcascade.replica.stage import ensure_stage

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


def test_a_peer_truncate_judges_a_local_change_that_commits_while_it_waits(db) -> None:
    """Master b applies a's TRUNCATE while a local transaction is changing a row a had seen: the
    change commits while the apply waits for the table, and must be judged against the TRUNCATE
    (newer, not seen by a: it stays, as the other masters keep it) - not removed unjudged."""
    with db.connect() as conn:
        conn.execute("create table t (id int primary key, v text)")
        conn.execute(
            "insert into pgcascade.set_table (queue_name, table_name, key_columns) values ('tw_b', 'public.t', '{id}')"
        )
        conn.execute("select pgcascade.two_way_table('public.t', '{id}', true)")
        conn.execute("insert into t values (1, 'seen by a'), (2, 'seen by a')")
        # what a had applied of b when it truncated: both rows
        conn.execute(
            "insert into pgcascade.peer_seen (queue_name, origin, seen_tick, seen_snapshot)"
            " values ('tw_a', 'b', 1, pg_current_snapshot())"
        )
        truncated_at = conn.execute("select now()").fetchone()[0]
    local = db.connect(autocommit=False)
    local.execute("update t set v = 'changed on b after' where id = 1")  # uncommitted: holds the row
    peer = PeerBatch("tw_a", "a", "b", "tw_b", 7, "last-update-wins", {})
    found: list[int] = []

    def apply() -> None:
        with db.connect(autocommit=False) as sub:
            ensure_stage(sub)
            sub.execute(
                "insert into pg_temp.pgcascade_stage (ev_id, ev_type, ev_extra1, ev_time) values (1, 'R', 'public.t', %s)",
                (truncated_at,),
            )
            sub.execute("select set_config('pgcascade.origin', 'a', true)")
            found.append(apply_peer_truncate(sub, "public.t", "public.t", ["id"], 1, peer))
            sub.commit()

    applier = threading.Thread(target=apply)
    applier.start()
    wait_until(lambda: db.scalar("select count(*) from pg_stat_activity where wait_event_type = 'Lock'") == 1)
    local.commit()  # while the apply waits for the table
    local.close()
    applier.join(timeout=30)
    assert found == [1], found
    with db.connect() as conn:
        assert conn.execute("select id, v from t").fetchall() == [(1, "changed on b after")]
        kinds = conn.execute("select conflict_type, row_key, winner from pgcascade.conflict").fetchall()
    assert kinds == [("update/truncate", [1], "local")], kinds
