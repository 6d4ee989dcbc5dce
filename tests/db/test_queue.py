"""The queue's semantics on a real server: batches, snapshots, rotation, retry, errors.

Expected results are computed from what the test itself committed (event ids returned by
insert_event in transactions that committed), never from the queue's own bookkeeping.
"""

from __future__ import annotations

import json
import random
import threading
import time
import tracemalloc
from collections import Counter

import psycopg
import pytest

from pgcascade.pgq import queue as q
from pgcascade.pgq.consumer import Batch, Consumer

Q = "testq"


def consume_all(conn: psycopg.Connection, queue: str, consumer: str) -> list[tuple[int, dict]]:
    """Finish every available batch with the SQL API; returns (batch_id, event row) pairs."""
    out = []
    while True:
        batch = conn.execute("select pgcascade.next_batch(%s, %s)", (queue, consumer)).fetchone()[0]
        if batch is None:
            return out
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            for ev in cur.execute("select * from pgcascade.get_batch_events(%s)", (batch,)):
                out.append((batch, ev))
        conn.execute("select pgcascade.finish_batch(%s)", (batch,))


@pytest.fixture
def qdb(db):
    with db.connect() as conn:
        q.create_queue(conn, Q)
        q.register_consumer(conn, Q, "c1")
    return db


def test_events_arrive_once_in_order_with_fields(qdb):
    with qdb.connect() as conn:
        ids = [
            q.insert_event(conn, Q, "t1", "d1"),
            q.insert_event(conn, Q, "t2", None, "e1", "e2", "e3", "e4"),
        ]
        with conn.transaction():
            ids.append(q.insert_event(conn, Q, "t3", 'it\'s \\ "quoted"\nnewline ünïcode'))
        q.ticker(conn, Q)
        got = consume_all(conn, Q, "c1")
        assert [ev["ev_id"] for _, ev in got] == ids
        assert got[1][1]["ev_data"] is None
        assert [got[1][1][f"ev_extra{i}"] for i in range(1, 5)] == ["e1", "e2", "e3", "e4"]
        assert got[2][1]["ev_data"] == 'it\'s \\ "quoted"\nnewline ünïcode'
        assert got[0][1]["ev_retry"] is None and got[0][1]["ev_type"] == "t1"
        assert consume_all(conn, Q, "c1") == []  # nothing twice


def test_open_batch_is_returned_again_until_finished(qdb):
    with qdb.connect() as conn:
        q.insert_event(conn, Q, "t", "x")
        q.ticker(conn, Q)
        b1 = conn.execute("select pgcascade.next_batch(%s, 'c1')", (Q,)).fetchone()[0]
        b2 = conn.execute("select pgcascade.next_batch(%s, 'c1')", (Q,)).fetchone()[0]
        assert b1 == b2 is not None
        info = conn.execute("select * from pgcascade.get_batch_info(%s)", (b1,)).fetchone()
        assert info[0] == Q and info[1] == "c1"
        conn.execute("select pgcascade.finish_batch(%s)", (b1,))
        assert conn.execute("select pgcascade.next_batch(%s, 'c1')", (Q,)).fetchone()[0] is None


def test_consumer_sees_only_events_after_it_registered(qdb):
    with qdb.connect() as conn:
        q.insert_event(conn, Q, "t", "before")
        q.ticker(conn, Q)
        q.register_consumer(conn, Q, "late")
        q.insert_event(conn, Q, "t", "after")
        q.ticker(conn, Q)
        assert [ev["ev_data"] for _, ev in consume_all(conn, Q, "late")] == ["after"]
        assert [ev["ev_data"] for _, ev in consume_all(conn, Q, "c1")] == ["before", "after"]


def test_batches_under_concurrent_writers_lose_and_split_nothing(qdb):
    """10k transactions from 4 connections while ticks fall at random: each committed event is
    delivered exactly once, each transaction whole in one batch, rolled-back ones never."""
    committed: dict[int, int] = {}  # ev_id -> writer's transaction number
    lock = threading.Lock()
    stop = threading.Event()

    def writer(wid: int) -> None:
        with qdb.connect(autocommit=False) as conn:
            for t in range(2500):
                n = random.randint(1, 4)
                ids = [q.insert_event(conn, Q, "w", f"{wid}:{t}:{i}") for i in range(n)]
                if t % 17 == 0:
                    conn.rollback()
                    continue
                conn.commit()
                with lock:
                    committed.update(dict.fromkeys(ids, wid * 100000 + t))

    def ticker() -> None:
        with qdb.connect() as conn:
            while not stop.is_set():
                q.ticker(conn, Q)
                time.sleep(random.uniform(0, 0.01))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    tick_thread = threading.Thread(target=ticker)
    tick_thread.start()
    delivered: list[tuple[int, dict]] = []
    with qdb.connect() as conn:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            delivered += consume_all(conn, Q, "c1")
            time.sleep(0.005)
        stop.set()
        tick_thread.join()
        q.ticker(conn, Q)
        delivered += consume_all(conn, Q, "c1")

    ids = [ev["ev_id"] for _, ev in delivered]
    dupes = [i for i, n in Counter(ids).items() if n > 1]
    assert not dupes, f"delivered twice: {dupes[:10]}"
    assert set(ids) == set(committed), (
        f"missing {len(set(committed) - set(ids))}, unexpected {len(set(ids) - set(committed))}"
    )
    batches_of_txn: dict[int, set[int]] = {}
    for batch, ev in delivered:
        batches_of_txn.setdefault(committed[ev["ev_id"]], set()).add(batch)
    split = {t: b for t, b in batches_of_txn.items() if len(b) > 1}
    assert not split, f"transactions split across batches: {list(split.items())[:5]}"
    assert len({b for b, _ in delivered}) > 20, "the test should have seen many batches"


def test_long_transaction_is_delivered_whole_in_the_batch_after_its_commit(qdb):
    with qdb.connect() as conn, qdb.connect(autocommit=False) as long_tx:
        long_ids = [q.insert_event(long_tx, Q, "long", f"l{i}") for i in range(50)]
        for i in range(5):  # several ticks and batches while it is open
            q.insert_event(conn, Q, "short", f"s{i}")
            q.ticker(conn, Q)
            got = consume_all(conn, Q, "c1")
            assert [ev["ev_data"] for _, ev in got] == [f"s{i}"]
        long_tx.commit()
        q.insert_event(conn, Q, "short", "after")
        tick_after_commit = q.ticker(conn, Q)
        got = consume_all(conn, Q, "c1")
        assert sorted(ev["ev_id"] for _, ev in got if ev["ev_type"] == "long") == long_ids
        assert len({b for b, _ in got}) == 1
        assert (
            conn.execute("select last_tick from pgcascade.get_consumer_info(%s, 'c1')", (Q,)).fetchone()[0]
            == tick_after_commit
        )


def rotate(conn: psycopg.Connection, queue: str) -> int:
    return conn.execute("select pgcascade.maint_rotate_tables(%s)", (queue,)).fetchone()[0]


def event_rows(conn: psycopg.Connection, queue: str) -> int:
    qid = conn.execute("select queue_id from pgcascade.queue where queue_name = %s", (queue,)).fetchone()[0]
    return conn.execute(
        "select count(*) from pgcascade.event where ev_part >= %s and ev_part < %s", (qid * 16, qid * 16 + 16)
    ).fetchone()[0]


def test_rotation_under_load_loses_nothing(qdb):
    with qdb.connect() as conn:
        q.set_queue_config(conn, Q, "rotation_period", "0")
    committed: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        with qdb.connect(autocommit=False) as conn:
            while not stop.is_set():
                committed.extend(q.insert_event(conn, Q, "w", "x") for _ in range(random.randint(1, 20)))
                conn.commit()

    def rotator(counts: list[int]) -> None:
        with qdb.connect() as conn:
            while not stop.is_set():
                q.ticker(conn, Q)
                counts.append(rotate(conn, Q))
                time.sleep(0.01)

    rotations: list[int] = []
    threads = [threading.Thread(target=writer) for _ in range(2)] + [
        threading.Thread(target=rotator, args=(rotations,))
    ]
    delivered: list[int] = []
    with qdb.connect() as conn:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            delivered += [ev["ev_id"] for _, ev in consume_all(conn, Q, "c1")]
        stop.set()
        for t in threads:
            t.join()
        q.ticker(conn, Q)
        delivered += [ev["ev_id"] for _, ev in consume_all(conn, Q, "c1")]
    assert sum(rotations) >= 6, f"only {sum(rotations)} rotations happened"
    assert len(delivered) == len(set(delivered)), "an event was delivered twice"
    assert sorted(delivered) == sorted(committed)


def test_stalled_consumer_holds_rotation_and_shows_lag(qdb):
    with qdb.connect() as conn:
        q.register_consumer(conn, Q, "stalled")
        q.set_queue_config(conn, Q, "rotation_period", "0")
        ids = [q.insert_event(conn, Q, "t", f"e{i}") for i in range(100)]
        q.ticker(conn, Q)
        consume_all(conn, Q, "c1")
        # the slot holding the events is the current one; rotation may move off it (slots 1, 2)
        # but never truncate it while "stalled" has not passed its events
        results = [rotate(conn, Q) for _ in range(6)]
        assert results[:2] == [1, 1] and results[2:] == [0, 0, 0, 0], results
        assert event_rows(conn, Q) == 100
        time.sleep(0.2)
        info = {r["consumer_name"]: r for r in q.consumer_info(conn, Q)}
        assert info["stalled"]["pending_events"] == 100
        assert info["stalled"]["lag"].total_seconds() >= 0.2
        assert info["stalled"]["lag"] > info["c1"]["lag"]
        # the stalled consumer still gets every event, then rotation goes on and empties the slot
        assert sorted(ev["ev_id"] for _, ev in consume_all(conn, Q, "stalled")) == ids
        assert rotate(conn, Q) == 1
        assert event_rows(conn, Q) == 0


def test_watermark_registration_holds_rotation_until_moved(qdb):
    with qdb.connect() as conn:
        start_tick = conn.execute("select last_tick_id from pgcascade.get_queue_info(%s)", (Q,)).fetchone()[0]
        conn.execute("select pgcascade.register_consumer_at(%s, '.global_watermark', %s)", (Q, start_tick))
        q.set_queue_config(conn, Q, "rotation_period", "0")
        q.insert_event(conn, Q, "t", "x")
        tick = q.ticker(conn, Q)
        consume_all(conn, Q, "c1")
        assert [rotate(conn, Q) for _ in range(4)] == [1, 1, 0, 0]
        assert event_rows(conn, Q) == 1
        conn.execute("select pgcascade.register_consumer_at(%s, '.global_watermark', %s)", (Q, tick))
        assert rotate(conn, Q) == 1
        assert event_rows(conn, Q) == 0


def test_unregister_releases_rotation_and_tick_cleanup_follows_slowest(qdb):
    with qdb.connect() as conn:
        q.register_consumer(conn, Q, "gone")
        q.set_queue_config(conn, Q, "rotation_period", "0")
        q.insert_event(conn, Q, "t", "x")
        for _ in range(3):
            q.ticker(conn, Q)
        consume_all(conn, Q, "c1")
        oldest = conn.execute("select min(tick_id) from pgcascade.tick").fetchone()[0]
        conn.execute("select pgcascade.maint_tick_cleanup(%s)", (Q,))
        assert (
            conn.execute("select min(tick_id) from pgcascade.tick").fetchone()[0] == oldest
        )  # "gone" needs it
        assert [rotate(conn, Q) for _ in range(3)] == [1, 1, 0]
        q.unregister_consumer(conn, Q, "gone")
        assert rotate(conn, Q) == 1
        conn.execute("select pgcascade.maint_tick_cleanup(%s)", (Q,))
        last = conn.execute("select last_tick from pgcascade.get_consumer_info(%s, 'c1')", (Q,)).fetchone()[0]
        assert conn.execute("select min(tick_id) from pgcascade.tick").fetchone()[0] == last


def test_retry_redelivers_to_its_consumer_only(qdb):
    with qdb.connect() as conn:
        q.register_consumer(conn, Q, "other")
        ev_id = q.insert_event(conn, Q, "t", "retry me", "x1")
        q.ticker(conn, Q)
        batch = conn.execute("select pgcascade.next_batch(%s, 'c1')", (Q,)).fetchone()[0]
        conn.execute("select pgcascade.event_retry(%s, %s, 0)", (batch, ev_id))
        conn.execute("select pgcascade.finish_batch(%s)", (batch,))
        assert [ev["ev_id"] for _, ev in consume_all(conn, Q, "other")] == [ev_id]
        assert conn.execute("select pgcascade.maint_retry_events()").fetchone()[0] == 1
        q.ticker(conn, Q)
        again = consume_all(conn, Q, "c1")
        assert [(ev["ev_id"], ev["ev_retry"], ev["ev_data"], ev["ev_extra1"]) for _, ev in again] == [
            (ev_id, 1, "retry me", "x1")
        ]
        assert consume_all(conn, Q, "other") == []


def test_retry_not_due_yet_stays_parked(qdb):
    with qdb.connect() as conn:
        ev_id = q.insert_event(conn, Q, "t", "later")
        q.ticker(conn, Q)
        batch = conn.execute("select pgcascade.next_batch(%s, 'c1')", (Q,)).fetchone()[0]
        conn.execute("select pgcascade.event_retry(%s, %s, 3600)", (batch, ev_id))
        conn.execute("select pgcascade.finish_batch(%s)", (batch,))
        assert conn.execute("select pgcascade.maint_retry_events()").fetchone()[0] == 0
        q.ticker(conn, Q)
        assert consume_all(conn, Q, "c1") == []


def test_consumer_class_finishes_only_on_success_and_retries_atomically(qdb):
    class Flaky(Consumer):
        def __init__(self, *a):
            super().__init__(*a)
            self.fail = True
            self.seen: list[int] = []

        def process_batch(self, batch: Batch) -> None:
            events = list(batch.events())
            for ev in events:
                if ev.ev_data == "retry":
                    batch.retry(ev, 0)
            if self.fail:
                self.fail = False
                raise RuntimeError("boom")
            self.seen += [ev.ev_id for ev in events]

    with qdb.connect() as conn:
        ids = [q.insert_event(conn, Q, "t", d) for d in ("a", "retry", "b")]
        q.ticker(conn, Q)
        c = Flaky(qdb.connstr, Q, "c1")
        with pytest.raises(RuntimeError):
            c.run_once()
        assert conn.execute("select count(*) from pgcascade.retry_queue").fetchone()[0] == 0  # rolled back
        assert c.run_once() is not None
        assert c.seen == ids
        assert c.run_once() is None
        conn.execute("select pgcascade.maint_retry_events()")
        q.ticker(conn, Q)
        assert c.run_once() is not None
        assert c.seen == [*ids, ids[1]]
        c.close()


def test_batch_streams_in_bounded_memory(qdb):
    n = 30_000
    with qdb.connect() as conn:
        conn.execute(
            "select pgcascade.insert_event(%s, 'big', repeat('x', 200)) from generate_series(1, %s)", (Q, n)
        )
        q.ticker(conn, Q)

    class Counting(Consumer):
        count = 0
        total = 0

        def process_batch(self, batch: Batch) -> None:
            for ev in batch.events():
                self.count += 1
                self.total += len(ev.ev_data)

    c = Counting(qdb.connstr, Q, "c1", fetch_size=500)
    tracemalloc.start()
    c.run_once()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    c.close()
    assert c.count == n and c.total == n * 200
    # fetched whole, the batch peaks at ~16 MB of Python objects (measured with fetch_size=n);
    # streaming keeps a fetch's worth (~0.6 MB)
    assert peak < 3_000_000, f"peak {peak / 1e6:.1f} MB"


def test_explicit_tick_ids_for_external_ticker(qdb):
    with qdb.connect() as conn:
        q.set_queue_config(conn, Q, "external_ticker", "true")
        with pytest.raises(psycopg.Error, match="takes its ticks from its provider"):
            q.ticker(conn, Q)
        ev = q.insert_event(conn, Q, "t", "x")
        assert conn.execute("select pgcascade.ticker(%s, 100, now(), 42)", (Q,)).fetchone()[0] == 100
        with pytest.raises(psycopg.Error, match="not after its last tick"):
            conn.execute("select pgcascade.ticker(%s, 100, now(), 43)", (Q,))
        got = consume_all(conn, Q, "c1")
        assert [e["ev_id"] for _, e in got] == [ev]
        info = conn.execute(
            "select last_tick, pending_events from pgcascade.get_consumer_info(%s, 'c1')", (Q,)
        )
        assert info.fetchone()[0] == 100


def test_events_and_tick_in_one_transaction_are_one_batch(qdb):
    """What a cascade branch does: copy events and make the provider's tick in one transaction."""
    with qdb.connect() as conn:
        q.set_queue_config(conn, Q, "external_ticker", "true")
        with conn.transaction():
            ids = [q.insert_event(conn, Q, "t", f"{i}") for i in range(3)]
            conn.execute("select pgcascade.ticker(%s, 7, now(), null)", (Q,))
        assert [e["ev_id"] for _, e in consume_all(conn, Q, "c1")] == ids


def test_bad_input_gives_clear_errors(qdb):
    with qdb.connect() as conn:
        cases = [
            ("select pgcascade.insert_event('nosuch', 't', 'd')", 'queue "nosuch" does not exist'),
            ("select pgcascade.ticker('nosuch')", 'queue "nosuch" does not exist'),
            ("select pgcascade.register_consumer('nosuch', 'c')", 'queue "nosuch" does not exist'),
            (
                "select pgcascade.next_batch('testq', 'nobody')",
                'consumer "nobody" is not registered on queue "testq"',
            ),
            (
                "select pgcascade.unregister_consumer('testq', 'nobody')",
                'consumer "nobody" is not registered',
            ),
            ("select pgcascade.finish_batch(123456)", "batch 123456 is not open"),
            ("select pgcascade.get_batch_events(123456)", "batch 123456 is not open"),
            (
                "select pgcascade.set_queue_config('testq', 'colour', 'red')",
                'unknown queue parameter "colour"',
            ),
            ("select pgcascade.create_queue('')", "queue name must not be empty"),
            ("select pgcascade.drop_queue('testq')", "still has 1 registered consumer"),
        ]
        for stmt, message in cases:
            with pytest.raises(psycopg.Error) as e:
                conn.execute(stmt)
            assert message in e.value.diag.message_primary, stmt
        q.insert_event(conn, Q, "t", "x")
        q.ticker(conn, Q)
        batch = conn.execute("select pgcascade.next_batch('testq', 'c1')").fetchone()[0]
        conn.execute("select pgcascade.finish_batch(%s)", (batch,))
        with pytest.raises(psycopg.Error, match=f"batch {batch} is not open"):
            conn.execute("select pgcascade.finish_batch(%s)", (batch,))
        q.set_queue_config(conn, Q, "disable_insert", "true")
        with pytest.raises(psycopg.Error, match="does not accept events"):
            q.insert_event(conn, Q, "t", "x")


def test_drop_queue_removes_its_tables(qdb):
    with qdb.connect() as conn:
        q.create_queue(conn, "other")
        q.insert_event(conn, "other", "t", "x")
        q.drop_queue(conn, Q, force=True)
        assert conn.execute("select count(*) from pgcascade.queue").fetchone()[0] == 1
        parts = conn.execute(
            "select count(*) from pg_inherits where inhparent = 'pgcascade.event'::regclass"
        ).fetchone()[0]
        assert parts == 3
        assert q.create_queue(conn, Q) is True  # the name is free again
        assert q.create_queue(conn, Q) is False


def test_xid8_of_gives_the_full_id_of_a_row_writer_this_transaction_included(db) -> None:
    """Two-way conflict detection compares a row's xmin, widened to 64 bits, with recorded
    transaction ids: the widening must hold for this transaction's own id, which is past the
    statement snapshot's xmax, and for a committed one."""
    with db.connect(autocommit=False) as conn:
        conn.execute("create table t (id int primary key)")
        conn.execute("insert into t values (1)")
        committed = conn.execute("select pg_current_xact_id()").fetchone()[0]
        conn.commit()
        # a snapshot taken, other transactions' ids assigned, then this one's: past its xmax
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("select 1")
        with db.connect() as other:
            for _ in range(3):
                other.execute("select pg_current_xact_id()")
        conn.execute("insert into t values (2)")
        own = conn.execute("select pg_current_xact_id()").fetchone()[0]
        widened = dict(conn.execute("select id, pgcascade.xid8_of(xmin) from t").fetchall())
    assert widened == {1: committed, 2: own}


def test_a_long_transaction_committed_between_two_ticks_is_not_inlined(qdb):
    # its events were numbered before the earlier tick, so the ticks' event counters say the
    # batch is empty: inlining would aggregate every event into one JSON text (past 1 GB for
    # a 5M-row UPDATE: an error at every try), so the count of what committed decides
    with qdb.connect() as writer, qdb.connect() as conn:
        with writer.transaction():
            ids = [q.insert_event(writer, Q, "t", str(i)) for i in range(5)]
            q.ticker(conn, Q)  # numbers 1..5 are taken, none committed
            q.finish_batch(conn, q.next_batch_info(conn, Q, "c1").batch_id)
        q.ticker(conn, Q)
        info = q.next_batch_events(
            conn, Q, "c1", finish=None, max_events=None, max_tick=None, inline_events=3
        )
        assert info.cur_tick_event_seq == info.prev_tick_event_seq  # the counters see nothing
        assert info.events is None and info.event_sql is not None
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            assert [ev["ev_id"] for ev in cur.execute(info.event_sql)] == ids
        q.finish_batch(conn, info.batch_id)
        q.insert_event(conn, Q, "t", "small")
        q.ticker(conn, Q)
        small = q.next_batch_events(
            conn, Q, "c1", finish=None, max_events=None, max_tick=None, inline_events=3
        )
        assert small.event_sql is None and '"small"' in (small.events or "")


def test_a_consumer_ticks_when_a_transaction_open_at_the_last_tick_commits(qdb):
    """next_batch_events ticks on demand for events committed since the last tick - those of a
    transaction that was in progress at that tick too - and makes no tick while they are not."""

    def fetch(conn: psycopg.Connection, finish: int | None = None):
        return q.next_batch_events(
            conn, Q, "c1", finish=finish, max_events=None, max_tick=None, inline_events=100
        )

    with qdb.connect() as conn, qdb.connect(autocommit=False) as open_tx:
        open_ids = [q.insert_event(open_tx, Q, "open", f"o{i}") for i in range(3)]
        q.ticker(conn, Q)  # the open transaction is in this tick's snapshot, in progress
        consume_all(conn, Q, "c1")
        ticks = conn.execute("select count(*) from pgcascade.tick").fetchone()[0]
        assert fetch(conn).batch_id is None  # nothing committed waits: no tick
        assert conn.execute("select count(*) from pgcascade.tick").fetchone()[0] == ticks
        open_tx.commit()
        info = fetch(conn)
        assert info.batch_id is not None and info.events is not None
        assert sorted(e[0] for e in json.loads(info.events)) == open_ids


def test_an_open_transaction_newer_than_the_tick_neither_makes_a_tick_nor_hides_a_later_commit(qdb):
    """The first event numbered by a transaction newer than the last tick belongs to one still
    open: no tick for it; once a later transaction commits an event, the fetch ticks (the
    check goes past the open one) and the batch holds that event alone, then the open one's
    when it commits."""

    def fetch(conn: psycopg.Connection, finish: int | None = None):
        return q.next_batch_events(
            conn, Q, "c1", finish=finish, max_events=None, max_tick=None, inline_events=100
        )

    with qdb.connect() as conn, qdb.connect(autocommit=False) as open_tx:
        consume_all(conn, Q, "c1")
        q.ticker(conn, Q)
        consume_all(conn, Q, "c1")
        open_ids = [q.insert_event(open_tx, Q, "open", f"o{i}") for i in range(2)]
        ticks = conn.execute("select count(*) from pgcascade.tick").fetchone()[0]
        assert fetch(conn).batch_id is None  # only uncommitted events: no tick
        assert conn.execute("select count(*) from pgcascade.tick").fetchone()[0] == ticks
        later = q.insert_event(conn, Q, "later", "l")  # a newer transaction, committed
        info = fetch(conn)
        assert info.batch_id is not None and info.events is not None
        assert [e[0] for e in json.loads(info.events)] == [later]
        open_tx.commit()
        info = fetch(conn, finish=info.batch_id)
        assert info.batch_id is not None and info.events is not None
        assert sorted(e[0] for e in json.loads(info.events)) == open_ids


def test_sequence_values_of_a_batch_cover_a_row_committed_while_its_call_ticked(qdb):
    """The values of the subscriber's sequences come with each batch; a node promoted to root
    hands out values from them.  A transaction that takes a value and commits while the call
    that fetches the batch makes its tick is in the batch, so its value must be too (read
    before the tick, it was not: a promoted node's insert collided with a replicated row).
    The call is held, deterministically, just before it makes the tick's snapshot."""
    hold = 4242
    with qdb.connect() as conn:
        conn.execute("create sequence s")
        conn.execute(
            "create function hold_tick() returns trigger language plpgsql as"
            f" $$ begin perform pg_advisory_xact_lock({hold}); return null; end $$"
        )
        conn.execute(
            "create trigger hold before insert on pgcascade.tick for each statement execute function hold_tick()"
        )
        consume_all(conn, Q, "c1")
    fetched: dict[str, tuple] = {}
    with qdb.connect() as holder, qdb.connect() as writer, qdb.connect() as fetcher:
        holder.execute("select pg_advisory_lock(%s)", (hold,))
        q.insert_event(writer, Q, "t", "waiting")  # committed: the fetch will tick
        pid = fetcher.info.backend_pid

        def fetch() -> None:  # psycopg's own call: it lets the test's thread run while it waits
            fetched["batch"] = fetcher.execute(
                "select events, seq_values from pgcascade.next_batch_events(%s, 'c1', null, null, null,"
                " true, 100, array['s'], false)",
                (Q,),
            ).fetchone()

        thread = threading.Thread(target=fetch)
        thread.start()
        deadline = time.monotonic() + 10
        while holder.execute(
            "select wait_event is distinct from 'advisory' from pg_stat_activity where pid = %s", (pid,)
        ).fetchone()[0]:
            assert time.monotonic() < deadline, "the fetch never reached its tick"
            time.sleep(0.01)
        with writer.transaction():
            value = writer.execute("select nextval('s')").fetchone()[0]
            q.insert_event(writer, Q, "t", f"took {value}")
        holder.execute("select pg_advisory_unlock(%s)", (hold,))
        thread.join(timeout=10)
    events, seq_values = fetched["batch"]
    assert [e[3] for e in json.loads(events)] == ["waiting", f"took {value}"]
    assert seq_values == [value]


def test_inline_events_stay_under_a_byte_bound_and_can_carry_commit_times(qdb):
    """A small batch comes inline only while its events' data stay under 8 MB in all (the
    worker holds it in memory; JSON text stops at 1 GB): a few wide rows come by query. With
    commit_times (a two-way master), each inline event's time is its transaction's commit
    time, which a master compares versions by, not the time it was inserted."""

    def fetch(conn: psycopg.Connection, commit_times: bool = False):
        return q.next_batch_events(
            conn,
            Q,
            "c1",
            finish=None,
            max_events=None,
            max_tick=None,
            inline_events=100,
            commit_times=commit_times,
        )

    with qdb.connect() as conn:
        consume_all(conn, Q, "c1")
        wide = [q.insert_event(conn, Q, "t", "x" * 3_000_000) for _ in range(3)]
        info = fetch(conn)
        assert info.batch_id is not None and info.events is None and info.event_sql is not None
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            assert [ev["ev_id"] for ev in cur.execute(info.event_sql)] == wide
        q.finish_batch(conn, info.batch_id)
        with conn.transaction():
            event = q.insert_event(conn, Q, "t", "late commit")
            time.sleep(0.2)  # inserted now, committed 0.2 s later
        committed = conn.execute(
            "select pg_xact_commit_timestamp(ev_txid::text::xid)::text from pgcascade.event where ev_id = %s",
            (event,),
        ).fetchone()[0]
        info = fetch(conn, commit_times=True)
        (e,) = json.loads(info.events or "[]")
        assert e[0] == event
        stamp = conn.execute("select %s::timestamptz::text", (e[5],)).fetchone()[0]
        assert stamp == committed


def test_a_two_way_marker_alone_makes_no_tick_on_demand(qdb):
    """A master's marker (written with each peer batch it applies) is no reason for a tick on
    demand: its peers need it only before the master's next change. Committed alone it waits
    (no tick, no batch); with a change after it both come in the change's batch, in order."""

    def fetch(conn: psycopg.Connection):
        return q.next_batch_events(
            conn, Q, "c1", finish=None, max_events=None, max_tick=None, inline_events=100
        )

    def ticks(conn: psycopg.Connection) -> int:
        return conn.execute("select count(*) from pgcascade.tick").fetchone()[0]

    with qdb.connect() as conn:
        consume_all(conn, Q, "c1")
        before = ticks(conn)
        marker = q.insert_event(conn, Q, "pgcascade.peer-seen", "7")
        assert fetch(conn).batch_id is None
        assert ticks(conn) == before
        change = q.insert_event(conn, Q, "t", "change")
        info = fetch(conn)
        assert ticks(conn) == before + 1
        assert info.batch_id is not None and info.events is not None
        assert [e[0] for e in json.loads(info.events)] == [marker, change]


def test_a_tick_on_demand_is_notified_only_where_another_consumer_may_listen(qdb):
    """A consumer alone on its queue reads the tick it asked for in the same call: nobody is
    woken (no NOTIFY per batch).  Once another consumer is registered, every tick on demand
    notifies it; the ticker's ticks always do."""

    def fetch(conn: psycopg.Connection, finish: int | None):
        return q.next_batch_events(
            conn, Q, "c1", finish=finish, max_events=None, max_tick=None, inline_events=100
        )

    def heard(listener: psycopg.Connection) -> list[str]:
        return [n.payload for n in listener.notifies(timeout=0.3)]

    with qdb.connect() as conn, qdb.connect() as listener:
        consume_all(conn, Q, "c1")
        listener.execute("listen pgcascade_tick")
        q.insert_event(conn, Q, "t", "alone")
        alone = fetch(conn, None)
        assert alone.batch_id is not None and alone.events is not None  # ticked on demand
        assert heard(listener) == []
        q.register_consumer(conn, Q, "c2")
        q.insert_event(conn, Q, "t", "with another")
        shared = fetch(conn, alone.batch_id)
        assert shared.batch_id is not None and shared.cur_tick_id == (alone.cur_tick_id or 0) + 1
        assert heard(listener) == [Q]
        q.unregister_consumer(conn, Q, "c2")
        q.ticker(conn, Q)
        assert heard(listener) == [Q]


def test_the_ticker_ticks_for_a_transaction_open_at_its_last_tick_once_it_commits(qdb):
    """The ticker daemon's check: events of a transaction in progress at the last tick wait once
    it commits (within ticker_max_lag, not the idle period), and do not while it is open."""

    def ticks(conn: psycopg.Connection) -> int:
        return conn.execute("select count(*) from pgcascade.tick").fetchone()[0]

    with qdb.connect() as conn, qdb.connect(autocommit=False) as open_tx:
        conn.execute(
            "update pgcascade.queue set queue_ticker_max_lag = '10 ms', queue_ticker_idle_period = '1 hour'"
            " where queue_name = %s",
            (Q,),
        )
        open_ids = [q.insert_event(open_tx, Q, "open", f"o{i}") for i in range(3)]
        q.ticker(conn, Q)  # counts the open transaction's events, in progress in its snapshot
        consume_all(conn, Q, "c1")
        before = ticks(conn)
        time.sleep(0.05)
        assert q.ticker(conn) == 0  # nothing committed since: no tick
        open_tx.commit()
        time.sleep(0.05)
        assert q.ticker(conn) == 1
        assert ticks(conn) == before + 1
        assert sorted(ev["ev_id"] for _, ev in consume_all(conn, Q, "c1")) == open_ids
        time.sleep(0.05)
        assert q.ticker(conn) == 0  # and once only


def test_the_ticker_round_says_when_a_tick_can_next_be_due(qdb):
    """ticker_round's second answer, the daemon's sleep: none before the last tick is
    ticker_max_lag old, sooner while events come fast enough to reach ticker_max_count, none at
    all once the last tick is older than that (an event may come at any moment)."""

    def round_() -> tuple[int, float]:
        return conn.execute("select ticks, due_in from pgcascade.ticker_round()").fetchone()

    with qdb.connect() as conn:
        conn.execute(
            "update pgcascade.queue set queue_ticker_max_lag = '2 s', queue_ticker_idle_period = '1 hour',"
            " queue_ticker_max_count = 1000 where queue_name = %s",
            (Q,),
        )
        q.ticker(conn, Q)
        ticks, due = round_()
        assert ticks == 0 and 1.5 < due <= 2.0, due  # just ticked: the lag's whole length
        time.sleep(0.3)
        for i in range(10):
            q.insert_event(conn, Q, "t", str(i))
        ticks, due = round_()
        # ten events in ~0.3 s: a thousand in ~30 s, after the lag's end
        assert ticks == 0 and 1.0 < due < 1.75, due
        conn.execute("update pgcascade.queue set queue_ticker_max_count = 12 where queue_name = %s", (Q,))
        ticks, due = round_()
        assert ticks == 0 and 0 < due < 0.2, due  # two more at that pace: ~0.06 s
        conn.execute("update pgcascade.queue set queue_ticker_max_lag = '50 ms' where queue_name = %s", (Q,))
        ticks, due = round_()
        assert ticks == 1 and 0.04 < due <= 0.05, due  # waited past the lag: ticked, the lag again
        time.sleep(0.1)
        assert round_() == (0, 0.0)  # nothing since, but the lag is over: ask again at once


def test_a_caught_up_fetch_reads_no_tick_table_scan_however_many_ticks_there_are(qdb):
    """A caught-up consumer's fetch finds the newest tick by the primary key: with thousands of
    ticks and their statistics, a generic plan once read every tick at every call."""
    with qdb.connect() as conn:
        conn.execute("select pgcascade.ticker(%s) from generate_series(1, 3000)", (Q,))
        batch = conn.execute(
            "select batch_id from pgcascade.next_batch_custom(%s, 'c1', 1000000, null)", (Q,)
        )
        conn.execute("select pgcascade.finish_batch(%s)", (batch.fetchone()[0],))
        assert conn.execute("select count(*) from pgcascade.tick").fetchone()[0] > 3000
        conn.execute("analyze pgcascade.tick")
    with qdb.connect(autocommit=False) as conn:  # one transaction: its own scans are counted
        for _ in range(12):  # past the 5 custom plans after which PL/pgSQL may keep a generic one
            info = q.next_batch_events(
                conn, Q, "c1", finish=None, max_events=None, max_tick=None, inline_events=100
            )
            assert info.batch_id is None
        scans = conn.execute(
            "select seq_scan from pg_stat_xact_user_tables where relid = 'pgcascade.tick'::regclass"
        ).fetchone()[0]
        assert scans == 0


def test_finishing_a_finished_batch_again_changes_nothing_and_scans_nothing(qdb):
    """A consumer that finishes its last batch again (its worker lost the answer) gets its next
    batch as if it had not: no scan of the subscriptions, no other consumer's batch finished."""
    with qdb.connect() as conn:
        q.register_consumer(conn, Q, "c2")
        q.insert_event(conn, Q, "t", "x")
        q.ticker(conn, Q)
        mine = q.next_batch_events(
            conn, Q, "c1", finish=None, max_events=None, max_tick=None, inline_events=100
        )
        other = q.next_batch_events(
            conn, Q, "c2", finish=None, max_events=None, max_tick=None, inline_events=100
        )
        q.insert_event(conn, Q, "t", "y")
        done = q.next_batch_events(
            conn, Q, "c1", finish=mine.batch_id, max_events=None, max_tick=None, inline_events=100
        )
        assert done.batch_id is not None and done.prev_tick_id == mine.cur_tick_id
    with qdb.connect(autocommit=False) as conn:  # one transaction: its own scans are counted
        again = q.next_batch_events(
            conn, Q, "c1", finish=mine.batch_id, max_events=None, max_tick=None, inline_events=100
        )
        assert again.batch_id == done.batch_id  # still open, returned again
        scans = conn.execute(
            "select seq_scan from pg_stat_xact_user_tables where relid = 'pgcascade.subscription'::regclass"
        ).fetchone()[0]
        assert scans == 0
        conn.commit()
        # c2's open batch, finished by nobody but c2
        assert (
            q.next_batch_events(
                conn, Q, "c2", finish=None, max_events=None, max_tick=None, inline_events=100
            ).batch_id
            == other.batch_id
        )


def tick_reads(conn: psycopg.Connection) -> tuple[int, int]:
    """(sequential scans, rows fetched by index) of the tick table, every session's flushed."""
    row = conn.execute(
        "select seq_scan, idx_tup_fetch from pg_stat_user_tables where relid = 'pgcascade.tick'::regclass"
    ).fetchone()
    assert row is not None
    return row


def test_fetch_plans_made_while_the_tick_table_was_small_still_read_ticks_by_index(qdb):
    """The ticker VACUUMs the tick table at its start, when it may hold a tick or two, and a
    worker's session keeps the plans it made then: once thousands of ticks are there, its
    fetches must still read a tick or two each, not the table (nor every tick by max())."""
    with qdb.connect() as setup, qdb.connect() as worker:
        setup.execute("alter table pgcascade.tick set (autovacuum_enabled = off)")  # no ANALYZE in between
        setup.execute("vacuum pgcascade.tick")
        batch = None

        def fetch_a_new_event() -> None:
            nonlocal batch
            q.insert_event(setup, Q, "t", "d")
            info = q.next_batch_events(
                worker, Q, "c1", finish=batch, max_events=None, max_tick=None, inline_events=100
            )
            assert info.batch_id is not None and info.events is not None  # the fetch made its tick
            batch = info.batch_id

        for _ in range(8):  # the worker's plans: made now, and past PL/pgSQL's 5 custom ones
            fetch_a_new_event()
        setup.execute("select pgcascade.finish_batch(%s)", (batch,))
        batch = None
        setup.execute("select pgcascade.ticker(%s) from generate_series(1, 3000)", (Q,))
        caught_up = setup.execute(
            "select batch_id from pgcascade.next_batch_custom(%s, 'c1', 1000000, null)", (Q,)
        ).fetchone()[0]
        setup.execute("select pgcascade.finish_batch(%s)", (caught_up,))
        for conn in (setup, worker):
            conn.execute("select pg_stat_force_next_flush()")
        scans_before, fetched_before = tick_reads(setup)
        for _ in range(12):
            fetch_a_new_event()
        worker.execute("select pg_stat_force_next_flush()")
        scans, fetched = tick_reads(setup)
        assert scans == scans_before
        assert fetched - fetched_before < 12 * 10  # (max() read all 3,000 at every fetch)
