"""The queue's doorbell (05_doorbell.sql): a caught-up worker on a root with trigger capture
sleeps on LISTEN, and the capture triggers notify the commits that follow - only while a
consumer listens, so a busy queue's writers pay no NOTIFY.  And a worker that sleeps so, with a
loop_delay far longer than its wait, still replays every change at once.

Real clusters; the notifications are read on a plain LISTEN connection, as the worker reads them.
"""

from __future__ import annotations

import time

import psycopg
from conftest import table_checksum

from pgcascade.pgq import queue as q

QUEUE = "rep"


def heard(conn: psycopg.Connection, timeout: float = 0.3) -> list[str]:
    """The payloads of the notifications `conn` received (within `timeout`), not its own."""
    me = conn.info.backend_pid
    return [n.payload for n in conn.notifies(timeout=timeout) if n.pid != me]


def listens(conn: psycopg.Connection, wait_ms: int, seen: int) -> bool:
    row = conn.execute("select pgcascade.consumer_listens(%s, %s, %s)", (QUEUE, wait_ms, seen)).fetchone()
    assert row is not None
    return bool(row[0])


def event_seq(conn: psycopg.Connection) -> int:
    row = conn.execute(
        "select coalesce(pg_sequence_last_value(queue_event_seq), 0) from pgcascade.queue where queue_name = %s",
        (QUEUE,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def root_capturing_t(replica) -> None:
    """A root (no leaf) whose queue captures table t."""
    with replica.root.connect() as c:
        c.execute("create table t (id int primary key, v text)")
    replica.run("root", "create-root", "root")
    replica.run("root", "add-table", "t")


def test_capture_rings_only_while_a_consumer_listens(replica):
    root_capturing_t(replica)
    with (
        psycopg.connect(replica.root.connstr, autocommit=True) as consumer,
        psycopg.connect(replica.root.connstr) as writer,
    ):
        consumer.execute("listen pgcascade_tick")
        writer.execute("insert into t values (1, 'nobody listens')")
        writer.commit()
        assert heard(consumer) == []

        consumer.execute("select pgcascade.ticker(%s)", (QUEUE,))  # the consumer is caught up
        seen = event_seq(consumer)
        assert listens(consumer, 3000, seen) is False  # nothing numbered since: it may sleep
        writer.execute("insert into t values (2, 'a')")
        writer.execute("update t set v = 'b' where id = 1")
        assert listens(consumer, 3000, seen) is True  # numbered, not committed: it must poll
        assert heard(consumer) == []  # nothing before the commit
        writer.commit()
        assert heard(consumer) == [QUEUE]  # one notification for the transaction
        writer.execute("delete from t where id = 2")
        writer.commit()
        writer.execute("truncate t")
        writer.commit()
        assert heard(consumer) == [QUEUE, QUEUE]
        writer.execute("update t set v = 'none' where id = 42")  # changes no row: no event
        writer.commit()
        assert heard(consumer) == []

        listens(consumer, 300, event_seq(consumer))  # not shorter than the 3 s still running...
        time.sleep(3.2)  # ...which run out: the doorbell is silent again
        writer.execute("insert into t values (3, 'after')")
        writer.commit()
        assert heard(consumer) == []


def fetches(db) -> int:
    """How often the worker asked the root for a batch (pg_stat_user_functions, track_functions)."""
    with db.connect() as c:
        c.execute("select pg_stat_clear_snapshot()")
        row = c.execute(
            "select coalesce(sum(calls), 0) from pg_stat_user_functions where funcname = 'next_batch_events'"
        ).fetchone()
    return int(row[0]) if row else 0


def test_an_idle_worker_sleeps_on_listen_and_replays_at_once(replica):
    for db in (replica.root, replica.leaf):
        with db.connect() as c:
            c.execute("create table t (id int primary key, v text)")
    with replica.root.connect() as c:
        c.execute(f'alter database "{replica.root.name}" set track_functions = pl')
    replica.setup(["t"], leaf_args=("--expect-sync",))
    replica.start_worker()  # no ticker: the worker makes the ticks, woken by the doorbell
    for i in range(3):
        with replica.root.connect() as c:
            c.execute("insert into t values (%s, 'row')", (i,))
        deadline = time.monotonic() + 30
        while table_checksum(replica.leaf, "t") != table_checksum(replica.root, "t"):
            assert time.monotonic() < deadline, f"change {i} not replayed within 30 s"
            time.sleep(0.05)
    time.sleep(3)  # the worker's wait grows to its longest (1 s) while idle
    before = fetches(replica.root)
    time.sleep(5)
    # a worker that polled would have asked every 50 ms at most (100 times); it asks once a second
    assert fetches(replica.root) - before <= 12
    with replica.root.connect() as c:
        c.execute("insert into t values (100, 'after the idle time')")
    deadline = time.monotonic() + 30
    while table_checksum(replica.leaf, "t") != table_checksum(replica.root, "t"):
        assert time.monotonic() < deadline, "the change after the idle time was not replayed"
        time.sleep(0.05)


def test_a_transaction_open_at_the_last_tick_keeps_the_consumer_polling(replica):
    """Its events were numbered before the tick (before the doorbell was set: it rings nobody at
    commit), so the consumer must not sleep while it runs, nor once it committed them."""
    root_capturing_t(replica)
    for outcome in ("commit", "rollback"):
        with (
            psycopg.connect(replica.root.connstr, autocommit=True) as consumer,
            psycopg.connect(replica.root.connstr) as writer,
        ):
            writer.execute(
                "insert into t values (%s, 'straddles a tick')", (1 if outcome == "commit" else 2,)
            )
            consumer.execute("select pgcascade.ticker(%s)", (QUEUE,))
            seen = event_seq(consumer)  # the tick's: the open transaction's events are below it
            assert listens(consumer, 3000, seen) is True  # in progress at the tick
            getattr(writer, outcome)()
            # committed since the tick: pending; rolled back: nothing is
            assert listens(consumer, 3000, seen) is (outcome == "commit")
            consumer.execute("select pgcascade.ticker(%s)", (QUEUE,))
            assert listens(consumer, 3000, event_seq(consumer)) is False


def test_a_fetch_that_finds_nothing_rings_and_one_that_finds_a_batch_does_not(replica):
    """next_batch_events with `listen`: the call that finds no batch sets the doorbell as
    consumer_listens would and answers its `pending`; a call that finds one leaves it alone."""
    root_capturing_t(replica)
    with (
        psycopg.connect(replica.root.connstr, autocommit=True) as consumer,
        psycopg.connect(replica.root.connstr) as writer,
    ):
        q.register_consumer(consumer, QUEUE, "c1")
        consumer.execute("listen pgcascade_tick")

        def fetch(listen: float | None, finish: int | None = None) -> q.BatchInfo:
            return q.next_batch_events(
                consumer, QUEUE, "c1", finish=finish, max_events=None, max_tick=None, inline_events=100,
                listen=listen,
            )  # fmt: skip

        info = fetch(None)
        while info.batch_id is not None:  # what create-root and add-table queued
            info = fetch(None, finish=info.batch_id)
        info = fetch(0.5)
        assert (info.batch_id, info.pending) == (None, False)  # nothing numbered: it may sleep
        writer.execute("insert into t values (1, 'rings')")
        writer.commit()
        assert heard(consumer) == [QUEUE]
        time.sleep(0.6)  # the doorbell runs out
        info = fetch(3.0)
        assert info.batch_id is not None and info.pending is None  # a batch: no ring
        writer.execute("insert into t values (2, 'nobody listens')")
        writer.commit()
        assert heard(consumer) == []
        info = fetch(3.0, finish=info.batch_id)  # the insert of 2, ticked on demand
        assert info.batch_id is not None
        info = fetch(3.0, finish=info.batch_id)
        assert (info.batch_id, info.pending) == (None, False)
        writer.execute("insert into t values (3, 'numbered, not committed')")
        info = fetch(3.0)
        assert (info.batch_id, info.pending) == (None, True)  # it must poll
        writer.commit()  # and the commit rings: the fetch set the doorbell for 3 s
        assert heard(consumer) == [QUEUE]
        assert fetch(None).batch_id is not None
