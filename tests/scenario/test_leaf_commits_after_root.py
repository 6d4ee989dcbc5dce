"""A leaf's worker gets its batch before the fetch's commit on the root is done (the tick it
made waits for its WAL flush meanwhile) and applies it, but commits it only once the root's
commit is.  Held here by synchronous replication to a standby that is not there: the tick's
commit waits for it, and the leaf must not show the batch until it is confirmed - a failover
to that standby would lose the tick.  Equality is checked outside pgcascade (an md5 of every
row), "once" by an audit trigger."""

from __future__ import annotations

import time

from test_replication import PGBENCH_TABLES, assert_applied_once, bench_replica  # noqa: F401

from pgcascade.dev.localcluster import wait_until

HISTORY = "insert into pgbench_history (tid, bid, aid, delta, mtime) values (1, 1, 1, %s, now())"
WAITING = (
    "select count(*) from pg_stat_activity where datname = current_database()"
    " and wait_event = 'SyncRep' and application_name = 'pgcascade worker'"
)


def set_standby(cluster, name: str | None) -> None:
    """The cluster's synchronous standby (None: none, as before)."""
    with cluster.connect() as conn:
        if name is None:
            conn.execute("alter system reset synchronous_standby_names")
        else:
            conn.execute(f"alter system set synchronous_standby_names = '{name}'")
        conn.execute("select pg_reload_conf()")


def history_rows(r, delta: int) -> int:
    return r.leaf.scalar("select count(*) from pgbench_history where delta = %s", (delta,))


def hold_a_row(r, delta: int) -> None:
    """A row committed on the root while its synchronous standby is missing: the worker's
    fetch makes the row's tick, and its commit waits for the standby.  The leaf must not show
    the row meanwhile, though the worker has had its batch for a second."""
    set_standby(r.root.cluster, "absent")
    with r.root.connect() as conn:
        conn.execute("set synchronous_commit = local")  # the application's commit is not held
        conn.execute(HISTORY, (delta,))
    wait_until(lambda: r.root.scalar(WAITING) == 1, 30, what="the worker's fetch waiting for the standby")
    time.sleep(1)
    assert history_rows(r, delta) == 0


def test_a_batch_is_committed_on_the_leaf_only_once_its_tick_is_on_the_root(bench_replica):
    """Once with the worker waiting until the standby is given up (the row then comes), once
    with the worker SIGKILLed while it waits (the leaf's open transaction is rolled back; the
    next worker applies the batch, once)."""
    r = bench_replica
    ticker = r.start_ticker()
    worker = r.start_worker()
    r.wait_sync()
    r.daemons.kill(ticker)  # its ticks would wait for the standby too
    try:
        hold_a_row(r, 101)
        set_standby(r.root.cluster, None)
        wait_until(
            lambda: history_rows(r, 101) == 1, 30, what="the row on the leaf once its tick is committed"
        )
        hold_a_row(r, 102)
        r.daemons.kill(worker)
    finally:
        set_standby(r.root.cluster, None)
    r.start_worker()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)
    assert history_rows(r, 102) == 1
