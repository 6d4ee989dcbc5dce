"""Two-way: a master applies a peer's batch only once the fetch's commit on the peer is done
(the tick its fetch made there, which waits for its WAL flush).  Held here by synchronous
replication of the peer to a standby that is not there: the tick's commit waits for it, and the
master must not show the batch until it is confirmed - a failover of the peer to that standby
would lose the tick.  Equality is checked outside pgcascade (an md5 of every row), "once" by an
ENABLE ALWAYS trigger."""

from __future__ import annotations

import time

from conftest import Daemons
from test_leaf_commits_after_root import WAITING, set_standby
from test_two_way import APPLIED_LOG, TwoWaySet, assert_applied_once, two_way  # noqa: F401 (the fixture)

from pgcascade.dev.localcluster import wait_until


def hold_a_row(two_way: TwoWaySet, row: int) -> None:
    """A row committed on a while a's synchronous standby is missing: b's worker's fetch makes
    the row's tick on a, and its commit waits for the standby.  b must not show the row
    meanwhile."""
    a = two_way.masters["a"]
    set_standby(a.db.cluster, "absent")
    with a.db.connect() as conn:
        conn.execute("set synchronous_commit = local")  # the application's commit is not held
        conn.execute("insert into history values (%s, 0, 1, 'a')", (row,))
    wait_until(lambda: a.db.scalar(WAITING) == 1, 30, what="b's fetch on a waiting for the standby")
    time.sleep(1)
    assert row not in two_way.rows_of("b", "history")


def test_a_peer_batch_is_committed_only_once_its_tick_is_on_the_peer(two_way: TwoWaySet, make_db) -> None:
    """Once with b's worker waiting until the standby is given up (the row then comes), once
    with it SIGKILLed while it waits (b's open transaction is rolled back; the next worker
    applies the batch, once).  No ticker runs: b's fetches make a's ticks."""
    masters = [two_way.add_master(n, make_db(n)) for n in ("a", "b")]
    for m in masters:
        m.execute("create table history (id bigint primary key, account int, delta int, origin text)")
        m.execute(APPLIED_LOG)
        m.run("add-table", "history")
    two_way.connect_all()
    a, b = masters
    for m in masters:
        m.worker = two_way.daemons.start(str(m.ini), "worker")
    a.execute("insert into history values (1, 0, 1, 'a')")
    wait_until(lambda: 1 in two_way.rows_of("b", "history"), 30, what="a's first row on b")
    try:
        hold_a_row(two_way, 2)
        set_standby(a.db.cluster, None)
        wait_until(lambda: 2 in two_way.rows_of("b", "history"), 30, what="the row on b once a's tick is")
        hold_a_row(two_way, 3)
        Daemons.kill(b.worker)
    finally:
        set_standby(a.db.cluster, None)
    b.worker = two_way.daemons.start(str(b.ini), "worker")
    a.execute("insert into history values (4, 0, 1, 'a')")
    two_way.wait_converged("history", timeout=60)
    assert_applied_once(b, {1, 2, 3, 4})
