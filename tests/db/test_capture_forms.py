"""What a captured table's triggers and functions are made of follows the table: the key-change
row triggers are `UPDATE OF` the key columns unless the table has a BEFORE UPDATE row trigger
that may change a key the UPDATE does not name (sql/capture/92_key_triggers.sql; the ticker's
maintenance makes them again when that changes, keeping how they fire), and only a two-way
table's capture functions read whether a peer's apply passes its changes on."""

from __future__ import annotations

from test_capture_update import MOVE


def forms(conn, table: str) -> dict[str, tuple[str, bool]]:
    """Each key-change trigger of the table: how it fires, and whether it names columns."""
    return {
        name: (enabled, specific)
        for name, enabled, specific in conn.execute(
            "select tgname::text, tgenabled::text, cardinality(tgattr::int2[]) > 0 from pg_trigger"
            " where tgrelid = %s::regclass and tgname like '%%\\_key' order by 1",
            (table,),
        )
    }


def test_a_before_trigger_takes_the_column_list_off_until_it_goes(db) -> None:
    with db.connect() as conn:
        conn.execute("create table t (id int primary key, v text)")
        conn.execute("insert into t select i, 'v' || i from generate_series(1, 5) i")
        conn.execute("select pgcascade.create_queue('q')")
        conn.execute(
            "insert into pgcascade.set_table (queue_name, table_name, key_columns) values ('q', 'public.t', '{id}')"
        )
        conn.execute("select pgcascade.capture_enable('q', 'public.t', '{id}', 'json')")
        conn.execute("select pgcascade.two_way_table('public.t', '{id}', true)")  # fires ALWAYS
        specific = {"_pgcascade_capture_key": ("A", True), "_pgcascade_tombstone_key": ("O", True)}
        assert forms(conn, "t") == specific
        assert conn.execute("select pgcascade.maint_key_triggers('q')").fetchone()[0] == 0

        conn.execute(MOVE)
        conn.execute("create trigger move before update on t for each row execute function move_key()")
        assert forms(conn, "t") == specific  # no auto DDL here: the maintenance sees it
        assert conn.execute("select pgcascade.maint_key_triggers('q')").fetchone()[0] == 1
        assert forms(conn, "t") == {
            "_pgcascade_capture_key": ("A", False),
            "_pgcascade_tombstone_key": ("O", False),
        }

        # an UPDATE that does not name the key, whose key the BEFORE trigger changes: the old key's
        # D and its tombstone, as when the statement names it
        with conn.transaction():
            conn.execute("update t set v = 'move' where id = 2")
            txid = conn.execute("select txid_current()").fetchone()[0]
        events = conn.execute(
            "select ev_type, ev_data::jsonb->>'id' from pgcascade.event where ev_txid = %s order by ev_id",
            (txid,),
        ).fetchall()
        assert events == [("D", "2"), ("U", "1002")]
        assert conn.execute(
            "select row_key, deleted from pgcascade.row_version where table_name = 'public.t'"
        ).fetchall() == [([2], True)]

        conn.execute("drop trigger move on t")
        assert conn.execute("select pgcascade.maint_key_triggers('q')").fetchone()[0] == 1
        assert forms(conn, "t") == specific


def test_only_a_two_way_tables_capture_reads_whether_a_peer_apply_passes_changes_on(db) -> None:
    def events_of_a_peer_apply(conn, forward: str) -> int:
        """Events captured by an UPDATE made as a peer's apply is (a replica session)."""
        with conn.transaction():
            conn.execute("set local session_replication_role = replica")
            conn.execute(
                "select set_config('pgcascade.origin', 'b', true), set_config('pgcascade.forward', %s, true)",
                (forward,),
            )
            conn.execute("update t set v = v || '.' where id = 1")
            txid = conn.execute("select txid_current()").fetchone()[0]
        return conn.execute("select count(*) from pgcascade.event where ev_txid = %s", (txid,)).fetchone()[0]

    with db.connect() as conn:
        conn.execute("create table t (id int primary key, v text)")
        conn.execute("insert into t values (1, 'a')")
        conn.execute("select pgcascade.create_queue('q')")
        conn.execute(
            "insert into pgcascade.set_table (queue_name, table_name, key_columns) values ('q', 'public.t', '{id}')"
        )
        conn.execute("select pgcascade.capture_enable('q', 'public.t', '{id}', 'json')")
        source = (
            "select prosrc from pg_proc where proname = 'capture_' || 'public.t'::regclass::oid || '_upd'"
            " and pronamespace = 'pgcascade'::regnamespace"
        )
        assert "pgcascade.forward" not in conn.execute(source).fetchone()[0]
        assert events_of_a_peer_apply(conn, "off") == 0  # one-way: the trigger does not fire there

        conn.execute("select pgcascade.two_way_table('public.t', '{id}', true)")
        assert events_of_a_peer_apply(conn, "on") == 1
        assert events_of_a_peer_apply(conn, "off") == 0
        conn.execute("select pgcascade.two_way_table('public.t', '{id}', false)")
        assert "pgcascade.forward" not in conn.execute(source).fetchone()[0]
