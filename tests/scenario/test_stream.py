"""A large batch applied in chunks while it streams (replica/stream.py): the leaf's rows equal
the root's (an md5 of every row, by PostgreSQL) when events of one key fall in different chunks,
when the queue's physical order is shuffled (late events), when the batch holds a TRUNCATE (it
is applied whole), after the worker is SIGKILLed between two chunks, and for a filtered table
and one with JSON columns."""

from __future__ import annotations

import signal

from conftest import query_checksum, table_checksum

from pgcascade.dev.localcluster import wait_until

CHUNK = 1000  # stream_chunk_events of the leaf's worker: the smallest allowed
TABLES = ("public.t", "public.u")


def setup(r) -> None:
    """Both tables replicated and the set's own events applied; the worker stopped."""
    ddl = ("create table t (id int primary key, v int, s text)", "create table u (id int primary key, v int)")
    r.set_up_stopped(ddl, TABLES, stream_chunk_events=CHUNK)


def write_batch(r, truncate: bool = False) -> None:
    """About 12,000 events in many transactions, each key changed in several chunks: inserts,
    updates, deletes, keys moved, keys deleted and inserted again."""
    with r.root.connect() as conn:
        conn.execute("insert into t select i, i, 'a' || i from generate_series(1, 3000) i")
        conn.execute("insert into u select i, i from generate_series(1, 2000) i")
        conn.execute("update t set v = v + 1")
        conn.execute("delete from t where id <= 500")
        if truncate:
            conn.execute("truncate u")
        conn.execute("insert into t select i, -i, 'b' from generate_series(3001, 3500) i")
        for lo in range(100, 2000, 400):  # small transactions, the same keys again
            conn.execute("update t set v = v * 2, s = s || 'x' where id between %s and %s", (lo, lo + 600))
        conn.execute("update t set id = id + 10000 where id between 2990 and 3000")
        conn.execute("insert into t select i, 0, 'again' from generate_series(1, 200) i")
        conn.execute("update u set v = v + 5 where id % 3 = 0")
        conn.execute("delete from u where id % 7 = 0")


def shuffle_queue(r) -> None:
    """The queue's row events, written again in a random physical order: the stream then meets
    most events after others of higher ev_id (late events in every chunk)."""
    with r.root.connect() as conn:
        conn.execute(
            "with gone as (delete from pgcascade.event where ev_type in ('I', 'U', 'D') returning *)"
            " insert into pgcascade.event select * from gone order by random()"
        )


def chunk_tables(r) -> int:
    return r.leaf.scalar("select count(*) from pg_class where relname like 'pgcascade_chunk_%'")


def applied_in_chunks(r) -> bool:
    """The batch's stats line says it streamed (logged just after its commit: waited for)."""
    try:
        wait_until(lambda: "stream: " in r.log(), 10, what="the streamed batch's stats line")
    except TimeoutError:
        return False
    return True


def test_large_batch_in_chunks_with_late_events_equals_the_root(replica):
    r = replica
    setup(r)
    write_batch(r)
    shuffle_queue(r)
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    for t in TABLES:
        r.assert_equal(t)
    assert applied_in_chunks(r), r.log()[-3000:]
    assert chunk_tables(r) == 0


def test_batch_with_a_truncate_past_its_first_chunk_is_applied_whole(replica):
    r = replica
    setup(r)
    write_batch(r, truncate=True)
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    for t in TABLES:
        r.assert_equal(t)
    assert "applying it whole" in r.log(), r.log()[-3000:]
    assert chunk_tables(r) == 0


def test_worker_sigkilled_between_chunks_leaves_nothing_and_applies_the_batch_once(replica):
    r = replica
    setup(r)
    write_batch(r)
    before = {t: r.leaf.scalar(f"select count(*) from {t}") for t in TABLES}
    r.start_ticker()
    pause = {"PGCASCADE_PAUSE_AT": "stream-chunk", "PGCASCADE_PAUSE_MIN_EVENTS": str(3 * CHUNK)}
    worker = r.start_worker(env={**pause, "PGCASCADE_PAUSE_SECONDS": "120"})
    paused = f"pause point stream-chunk (pid {worker.pid})"
    wait_until(lambda: paused in r.log(), 120, what=paused)
    assert chunk_tables(r) > 0  # the second session is ahead of the writes
    r.daemons.kill(worker)
    assert {t: r.leaf.scalar(f"select count(*) from {t}") for t in TABLES} == before
    r.start_worker()
    r.wait_sync()
    for t in TABLES:
        r.assert_equal(t)
    assert applied_in_chunks(r)
    assert chunk_tables(r) == 0


def test_filtered_and_json_tables_in_chunks(replica):
    """A leaf table with a row filter and one with JSON columns (their nulls restored by
    event_row), applied in chunks: the leaf holds exactly the root's rows the filter passes."""
    r = replica
    for db in (r.root, r.leaf):
        with db.connect() as conn:
            conn.execute("create table f (id int primary key, v int)")
            conn.execute("create table j (id int primary key, doc jsonb, n json)")
    r.ini("leaf", r.leaf, parallel_copies=2, stream_chunk_events=CHUNK)
    r.run("root", "create-root", "root")
    r.run("leaf", "create-leaf", "leaf1", "--provider", r.root.connstr)
    r.run("root", "add-table", "public.f", "public.j")
    r.run("leaf", "add-table", "public.f", "--where", "v % 2 = 0", "--expect-sync")
    r.run("leaf", "add-table", "public.j", "--expect-sync")
    worker = r.start_worker()
    r.wait_sync()
    r.daemons.kill(worker, signal.SIGTERM)
    worker.wait(30)
    with r.root.connect() as conn:
        conn.execute("insert into f select i, i from generate_series(1, 3000) i")
        conn.execute("update f set v = v + 1 where id % 3 = 0")  # moves rows in and out of the filter
        conn.execute(
            "insert into j select i, case when i % 4 = 0 then 'null' else jsonb_build_object('k', i) end,"
            " case when i % 5 = 0 then 'null'::json end from generate_series(1, 2500) i"
        )
        conn.execute("update j set doc = doc || '{\"u\": 1}' where id % 2 = 0 and doc <> 'null'")
        conn.execute("delete from f where id % 7 = 0")
    shuffle_queue(r)
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    assert query_checksum(r.root, "select * from f where v % 2 = 0") == table_checksum(r.leaf, "f")
    r.assert_equal("public.j")
    assert applied_in_chunks(r), r.log()[-3000:]
    assert r.leaf.scalar("select count(*) from j where doc = 'null'::jsonb") > 0  # JSON nulls kept
