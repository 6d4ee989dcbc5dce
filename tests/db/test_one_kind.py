"""A small batch's tables whose events are all of one kind are applied by a statement of that
kind alone (replica/applysql.py, one_kind_sql; replica/inline.py).  What a user checks: the
leaf's rows equal the root's after inserts, updates (a key updated twice in one transaction:
the last wins) and deletes, each kind alone in its batches and mixed; and a row the leaf lost is
written again by the update that finds it missing (the batch goes the set-based way, and says
so in the worker's log).
"""

from __future__ import annotations

TABLES = ["t", "u"]


def batch(replica, *statements: str) -> None:
    """Run `statements` in one transaction on the root and wait until the leaf applied it."""
    with replica.root.connect() as c, c.transaction():
        for s in statements:
            c.execute(s)
    replica.wait_sync()


def test_batches_of_one_kind_per_table_end_equal_and_a_lost_row_is_written_again(replica):
    for db in (replica.root, replica.leaf):
        with db.connect() as c:
            c.execute("create table t (id int primary key, v text, n numeric)")
            c.execute("create table u (a int, b text, v text, primary key (a, b))")
    replica.setup(TABLES, leaf_args=("--expect-sync",))
    replica.start_worker()

    batch(
        replica,
        "insert into t select g, 'v' || g, g / 3.0 from generate_series(1, 50) g",
        "insert into u select g % 5, 'k' || g, 'x' from generate_series(1, 40) g",
    )
    batch(replica, "update t set v = 'first' where id = 7", "update t set v = 'last', n = -0.5 where id = 7")
    batch(replica, "update t set n = n * 2 where id % 4 = 0", "update u set v = 'y' where a = 2")
    batch(replica, "delete from u where a = 3", "delete from t where id > 45")
    # mixed in one table: the set-based statement
    batch(replica, "insert into t values (100, 'new', 1)", "update t set v = 'moved' where id = 100")
    batch(replica, "update u set v = null where a = 1", "insert into t values (101, null, null)")
    replica.assert_equal(*TABLES)
    with replica.leaf.connect() as c:
        assert c.execute("select v, n from t where id = 7").fetchone() == ("last", -0.5)
    assert "set-based statements" not in replica.log()

    # a row the leaf lost, then updated on the root: written again
    with replica.leaf.connect() as c:
        c.execute("set session_replication_role = replica")
        c.execute("delete from t where id = 3")
    batch(replica, "update t set v = 'back' where id in (2, 3)")
    replica.assert_equal(*TABLES)
    assert "wrote 1 rows, not 2; applying it with the set-based statements" in replica.log()
