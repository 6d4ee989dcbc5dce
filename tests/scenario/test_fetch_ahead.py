"""A catching-up leaf fetches, stages and decodes its next large batch while it applies the
current one (replica/ahead.py): the leaf's rows equal the root's (an md5 of every row, by
PostgreSQL) after a backlog of several large batches, after the worker is SIGKILLed while the
batch fetched ahead is staged and the current one is not committed (the provider has finished
it already), after it is SIGKILLed between the current batch's commit and the next one's apply,
and when batches hold a TRUNCATE or DDL (not decoded ahead; the batch after the DDL, decoded
for the table as it was, goes through the stage).  Updates that add to a value show any batch
applied twice."""

from __future__ import annotations

from pgcascade.dev.localcluster import wait_until

ROWS = 25_000  # each transaction changes this many rows: a batch of at least AHEAD_MIN_EVENTS
TABLES = ("public.t", "public.h")


def setup(r) -> None:
    """Both tables replicated, the worker stopped."""
    ddl = (
        "create table t (id int primary key, v int)",
        "create table h (id bigint generated always as identity primary key, v int)",
    )
    # a batch merges ticks up to about this many events: one transaction, one batch
    r.set_up_stopped(ddl, TABLES, max_batch_events=ROWS)


BACKLOG = (
    f"insert into t select i, i from generate_series(1, {ROWS}) i",
    "update t set v = v + 1",
    f"insert into h (v) select i from generate_series(1, {ROWS}) i",
    "update t set v = v * 2",
    "update t set v = v + 3",
)


def write_backlog(r, statements: tuple[str, ...] = BACKLOG) -> None:
    """Transactions of ROWS changes each, a tick after each (no ticker runs: a tick in the
    middle of one would number some of its events in the batch before)."""
    with r.root.connect() as conn:
        for statement in statements:
            conn.execute(statement)
            conn.execute("select pgcascade.ticker('rep')")


def ahead_tables(r) -> int:
    return r.leaf.scalar("select count(*) from pg_class where relname like 'pgcascade_ahead_%'")


def assert_caught_up(r) -> None:
    r.wait_sync()
    for t in TABLES:
        r.assert_equal(t)
    wait_until(lambda: ahead_tables(r) == 0, 10, what="the fetch ahead's tables dropped")


def paused_at(r, point: str) -> object:
    """A worker that stops at `point` once a batch of ROWS events gets there."""
    env = {
        "PGCASCADE_PAUSE_AT": point,
        "PGCASCADE_PAUSE_MIN_EVENTS": str(ROWS),
        "PGCASCADE_PAUSE_SECONDS": "120",
    }
    worker = r.start_worker(env=env)
    paused = f"pause point {point} (pid {worker.pid})"
    wait_until(lambda: paused in r.log(), 120, what=paused)
    return worker


def test_backlog_applied_with_each_next_batch_staged_ahead(replica):
    r = replica
    setup(r)
    write_backlog(r)
    r.start_worker()
    assert_caught_up(r)
    assert r.log().count("ahead: ") == 4, r.log()[-3000:]  # batches taken from the table staged ahead


def test_worker_killed_with_the_next_batch_staged_and_this_one_open(replica):
    """The provider finished the batch under way before its commit here: the worker, started
    again, finds the provider ahead of its record and resumes at the record."""
    r = replica
    setup(r)
    write_backlog(r)
    before = {t: r.leaf.scalar(f"select count(*) from {t}") for t in TABLES}
    worker = paused_at(r, "staged-ahead")
    assert ahead_tables(r) == 3  # both turns' raw events, and the next batch's rows decoded
    applied = r.leaf.scalar("select last_tick from pgcascade.node where queue_name = 'rep'")
    provider_at = r.root.scalar(
        "select sub_last_tick from pgcascade.subscription where sub_batch is not null"
    )
    assert provider_at > applied  # the batch being applied is finished there
    r.daemons.kill(worker)
    assert {t: r.leaf.scalar(f"select count(*) from {t}") for t in TABLES} == before
    r.start_worker()
    assert_caught_up(r)
    assert "resuming there" in r.log()


def test_worker_killed_between_a_commit_and_the_batch_staged_ahead(replica):
    r = replica
    setup(r)
    write_backlog(r)
    worker = paused_at(r, "applied")
    r.daemons.kill(worker)
    r.start_worker()
    assert_caught_up(r)


def test_batches_the_fetch_ahead_cannot_decode_go_through_the_stage(replica, tmp_path):
    """A batch with a TRUNCATE, and one with DDL: their rows are not decoded ahead; and the
    batch after the DDL, decoded ahead for the table as it was, is applied for the table as it
    is now (its rows from the stage, by the new column list)."""
    r = replica
    setup(r)
    ddl = tmp_path / "add_w.sql"
    ddl.write_text("alter table t add column w int not null default 0;\n")
    with r.root.connect() as conn:
        write_backlog(r, (f"insert into t select i, i from generate_series(1, {ROWS}) i",))
        conn.execute(f"truncate h; insert into h (v) select i from generate_series(1, {ROWS}) i")
        conn.execute("select pgcascade.ticker('rep')")
        conn.execute("update t set v = v + 1")
        r.cli("root", "execute", str(ddl))  # in the update's batch: no tick between
        conn.execute("select pgcascade.ticker('rep')")
        write_backlog(r, ("update t set w = v * 3", "update t set v = v + w"))
    r.start_worker()
    assert_caught_up(r)
    assert r.leaf.scalar("select count(*) from t where w <> 0") == ROWS
    assert r.log().count("ahead: ") == 4, r.log()[-3000:]
