"""The plans of the statements a worker prepares (replica/prepared.py): made once a
second, not once per batch and not once for good.

A plan made while the destination was empty scans it whole (no index probe costs less than a
scan of nothing); PostgreSQL does not plan a statement again because its table grew.  What a
user would see is each batch getting slower as the table grows; what the test reads is the
table's own counters: once the table has grown for longer than PLAN_SECONDS, its batches are
applied by index probes, with no sequential scan.
"""

from __future__ import annotations

import time

from conftest import table_checksum

from pgcascade.replica.prepared import PLAN_SECONDS


def scans(db) -> tuple[int, int]:
    """(sequential scans, index scans) of t, from the server's statistics."""
    with db.connect() as c:
        c.execute("select pg_stat_clear_snapshot()")
        row = c.execute(
            "select seq_scan, coalesce(idx_scan, 0) from pg_stat_user_tables where relname = 't'"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_table_grown_from_empty_is_applied_by_index_probes(replica):
    for db in (replica.root, replica.leaf):
        with db.connect() as c:
            c.execute("create table t (id int primary key, v text)")
            c.execute("vacuum t")  # known to be empty: the plans made now scan it
    replica.setup(["t"], leaf_args=("--expect-sync",))
    replica.start_worker()
    with replica.root.connect() as c:  # the first plans: a batch of one row, into an empty table
        c.execute("insert into t values (0, 'first')")
    replica.wait_sync()
    started, n = time.monotonic(), 0
    with replica.root.connect() as c:
        # small transactions, so the worker applies many batches as the table grows
        while time.monotonic() - started < PLAN_SECONDS + 2 or n <= 20000:
            c.execute(
                "insert into t select g, 'row' from generate_series(%s::int, %s::int) g", (n + 1, n + 100)
            )
            n += 100
            time.sleep(0.02)
    replica.wait_sync()  # (reads no row of t: a checksum would scan it)
    time.sleep(1.5)  # the worker's backend reports its counters once idle, at most every second
    before = scans(replica.leaf)
    with replica.root.connect() as c:
        for i in range(1, 41):
            c.execute("update t set v = 'updated' where id = %s", (i * 7,))
            time.sleep(0.02)
    replica.wait_sync()
    time.sleep(1.5)
    seq, idx = scans(replica.leaf)
    assert n > 20000
    assert seq == before[0], f"{seq - before[0]} sequential scan(s) of a table of {n} rows"
    assert idx > before[1]
    assert table_checksum(replica.leaf, "t") == table_checksum(replica.root, "t")
