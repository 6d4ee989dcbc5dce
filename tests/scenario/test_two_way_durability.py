"""Two-way: a master commits its peers' batches without waiting for the WAL flush (as a leaf
does, docs/replication.md); a crash that takes applied batches back makes it apply them again
from its own record, once.  Convergence and "once" are checked outside pgcascade: an md5 of
every row on each master, and an ENABLE ALWAYS trigger that writes down each row a peer's apply
writes."""

from __future__ import annotations

import os
import signal
import time

import psycopg
import pytest
from conftest import Daemons
from test_replication import flush_wal, stop_wal_writer
from test_two_way import APPLIED_LOG, Master, TwoWaySet, assert_applied_once, two_way  # noqa: F401 (the fixture)

from pgcascade.dev.localcluster import wait_until


def test_a_master_that_crashes_losing_peer_batches_applies_them_again_once(
    two_way: TwoWaySet, make_db, private_cluster
) -> None:
    """A master commits its peers' batches without waiting for the WAL flush.  Master b applies
    a burst of a's rows with its WAL writer stopped (and no ticker: nothing of b's flushes its
    WAL), reports how far it is durable, a's maintenance runs behind that; then b crashes (its
    WAL writer SIGKILLed) and the crash takes applied batches back.  a still has them: b
    applies them again from its own record, every row once."""
    private_cluster.create_database("b")
    b_db = type(make_db("a"))(private_cluster, "b")
    masters = [two_way.add_master("a", make_db("a")), two_way.add_master("b", b_db)]
    a, b = masters
    with b.ini.open("a") as f:
        f.write("watermark_period = 0.1\n")
    for m in masters:
        m.execute("create table history (id bigint primary key, account int, delta int, origin text)")
        m.execute(APPLIED_LOG)
        m.run("add-table", "history")
    two_way.connect_all()
    two_way.start()
    n = 0
    for _attempt in range(3):
        n, lost = burst_and_crash(two_way, a, b, n)
        two_way.start("b")
        if lost:
            break
    else:
        pytest.fail("three crashes of b took no applied batch back: the test proves nothing")
    a.execute("insert into history values (%s, 0, 1, 'a')", (n + 1,))
    two_way.wait_converged("history", timeout=60)
    assert_applied_once(b, set(range(1, n + 2)))


def burst_and_crash(two_way: TwoWaySet, a: Master, b: Master, n: int) -> tuple[int, bool]:
    """Rows n+1.. written on a while b's WAL writer is stopped, b's crash once they are all
    applied there and a kept only what b reported durable: (the last row written, whether the
    crash took back batches b had applied)."""
    two_way.wait_converged("history", timeout=60)
    Daemons.kill(b.ticker)  # its durable ticks would flush b's WAL
    walwriter = stop_wal_writer(b.db)
    try:
        for half in range(2):
            for _ in range(20):
                n += 1
                a.execute("insert into history values (%s, 0, 1, 'a')", (n,))
                time.sleep(0.02)
            if half == 0:  # what b applied so far becomes durable: its watermark can name it
                wait_until(lambda last=n: last in two_way.rows_of("b", "history"), 30, what="the first half")
                flush_wal(b.db)
        wait_until(lambda last=n: last in two_way.rows_of("b", "history"), 30, what="the burst on b")
        applied = b.db.scalar("select last_tick from pgcascade.node where queue_name = 'tw_a'")
        since = a.db.scalar("select now()")
        wait_until(lambda: maintained_after(a, since), 60, what="b's watermark report and a's cleanup")
        Daemons.kill(b.worker)
    finally:
        os.kill(walwriter, signal.SIGKILL)  # the postmaster restarts the cluster: crash recovery

    def back() -> int | None:
        # after the restart, not before it: a connection made the instant the WAL writer died
        # still reads the tick the crash takes back (the postmaster has not reacted yet)
        try:
            restarted = b.db.scalar(
                "select coalesce(bool_and(pid <> %s), false) from pg_stat_activity where backend_type = 'walwriter'",
                (walwriter,),
            )
            if not restarted:
                return None
            return b.db.scalar("select last_tick from pgcascade.node where queue_name = 'tw_a'")
        except psycopg.OperationalError:
            return None

    return n, wait_until(back, 60, what="b back after its crash") < applied


def maintained_after(a: Master, since) -> bool:
    """b reported its watermark of a's queue after `since`, a's global watermark followed it and
    a's tick cleanup ran up to there."""
    return a.db.scalar(
        "select w.reported > %s and g.sub_last_tick >= w.watermark"
        " and (select min(tick_id) from pgcascade.tick) >= g.sub_last_tick"
        " from pgcascade.node_watermark w,"
        " pgcascade.subscription g join pgcascade.consumer c on c.co_id = g.sub_consumer"
        " where w.queue_name = 'tw_a' and c.co_name = '.global_watermark'",
        (since,),
    )
