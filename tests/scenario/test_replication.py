"""Table replication under load and under failure: pgbench on the root, the CLI and daemons as
processes, SIGKILL at random and at chosen points, server crashes.  Every test ends by comparing
an md5 of every row on both sides (computed by PostgreSQL); "applied twice" is caught by an
ENABLE ALWAYS trigger on the leaf that writes down every row the replay inserts or updates in
pgbench_history, whose rows the root only ever inserts.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time

import psycopg
import pytest

from pgcascade.dev.localcluster import pg_bindir, wait_until

PGBENCH_TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")


def pgbench_init(db, scale: int = 1) -> None:
    subprocess.run(
        [str(pg_bindir() / "pgbench"), "-i", "-q", "-s", str(scale), "-n", db.connstr],
        check=True,
        capture_output=True,
    )
    with db.connect() as conn:
        conn.execute("alter table pgbench_history add column hid bigserial primary key")


def pgbench(db, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(pg_bindir() / "pgbench"), "-n", *args, db.connstr],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def add_apply_audit(leaf) -> None:
    """Record every row the replay writes into the leaf's pgbench_history (ALWAYS: fires in replica mode)."""
    with leaf.connect() as conn:
        conn.execute("create table history_audit (hid int8, op text)")
        conn.execute(
            "create function audit_history() returns trigger language plpgsql as $$"
            " begin insert into history_audit values (new.hid, tg_op); return null; end $$"
        )
        conn.execute(
            "create trigger audit after insert or update on pgbench_history"
            " for each row execute function audit_history()"
        )
        conn.execute("alter table pgbench_history enable always trigger audit")


def assert_applied_once(replica) -> None:
    with replica.leaf.connect() as conn:
        rows, distinct, updates = conn.execute(
            "select count(*), count(distinct hid), count(*) filter (where op <> 'INSERT') from history_audit"
        ).fetchone()
        history = conn.execute("select count(*) from pgbench_history").fetchone()[0]
    if updates:
        with replica.leaf.connect() as conn, replica.root.connect() as rconn:
            twice = [r[0] for r in conn.execute("select hid from history_audit where op <> 'INSERT'")]
            events = rconn.execute(
                "select ev_id, ev_txid, ev_type, left(ev_data, 60) from pgcascade.event"
                " where ev_extra1 = 'public.pgbench_history' and (ev_data::jsonb->>'hid')::int8 = any(%s)",
                (twice,),
            ).fetchall()
        pytest.fail(f"history rows written twice: {twice}; their events: {events}")
    assert rows == distinct == history, (rows, distinct, history)


@pytest.fixture
def bench_replica(replica):
    """Root with pgbench tables (scale 1), leaf with the same tables created and audited."""
    pgbench_init(replica.root)
    replica.setup(list(PGBENCH_TABLES))
    add_apply_audit(replica.leaf)
    return replica


def test_pgbench_replicates_to_equality_while_copying(bench_replica):
    r = bench_replica
    r.start_ticker()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "6")  # TPC-B, running during the initial copy
    r.start_worker()
    assert load.wait(timeout=60) == 0, load.stderr.read()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)
    out = r.cli("leaf", "tables").stdout
    assert out.count(" ok") == 4, out
    log = r.log()
    assert re.search(
        r"\{count: \d+, ignored: \d+, duration: [\d.]+, prepare: [\d.]+, stage: [\d.]+, apply", log
    )
    for state in ("catching-up", "wanna-sync", "do-sync", "ok"):
        assert state in log, f"the log never mentions {state}"


def test_worker_sigkilled_20_times_loses_and_repeats_nothing(bench_replica):
    """SIGKILLed at random, and first at the points of the one-round-trip path: right after a
    fetch (it finished the last batch, ticked the root and opened the next batch; nothing
    applied) and right after a commit (applied, the batch still open on the root until the next
    fetch: the leaf's own record wins)."""
    r = bench_replica
    r.start_ticker()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "20", "-R", "300")
    for point in ("fetched", "applied"):
        worker = r.start_worker(env={"PGCASCADE_PAUSE_AT": point, "PGCASCADE_PAUSE_MIN_EVENTS": "1"})
        paused = f"pause point {point} (pid {worker.pid})"
        wait_until(lambda paused=paused: paused in r.log(), 60, what=paused)
        r.daemons.kill(worker)
    worker = r.start_worker()
    rng = random.Random(7)
    for _ in range(20):
        time.sleep(rng.uniform(0.1, 0.8))
        r.daemons.kill(worker)
        worker = r.start_worker()
    assert load.wait(timeout=60) == 0, load.stderr.read()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)
    assert "we applied up to" in r.log(), "the root had the batch open: the leaf's record must win"


def test_worker_sigkilled_mid_stream_and_mid_apply_of_a_large_transaction(bench_replica):
    """One 100,000-row UPDATE on the root, open across ticks (its events are numbered before
    the ticks that pass while it runs), is one batch: the worker is SIGKILLed while it streams
    the batch into its staging table, while the set-based statement runs, and after the rows
    are written but before the tick is recorded; each time the leaf keeps nothing of it, and
    the restarted worker applies it whole, each row once (an audit trigger counts the writes)."""
    r = bench_replica
    with r.leaf.connect() as conn:
        conn.execute("create table accounts_audit (aid int4)")
        conn.execute(
            "create function audit_accounts() returns trigger language plpgsql as $$"
            " begin insert into accounts_audit select aid from new_rows; return null; end $$"
        )
        conn.execute(
            "create trigger audit after update on pgbench_accounts referencing new table as new_rows"
            " for each statement execute function audit_accounts()"
        )
        conn.execute("alter table pgbench_accounts enable always trigger audit")
    r.start_ticker()
    worker = r.start_worker()
    r.wait_sync()
    with r.root.connect() as conn:
        conn.execute("begin")
        conn.execute("update pgbench_accounts set abalance = abalance + 7")
        n = r.root.scalar("select count(*) from pgbench_accounts")
        before = r.root.scalar("select coalesce(max(tick_id), 0) from pgcascade.tick")
        wait_until(  # ticks pass while it is open
            lambda: r.root.scalar("select max(tick_id) from pgcascade.tick") > before + 1, 30, what="ticks"
        )
        conn.execute("commit")

    mid_stream = (
        "select count(*) from pg_stat_progress_copy p join pg_stat_activity a using (pid)"
        " where p.datname = current_database() and p.tuples_processed > 1000"
        " and a.query like 'copy pg_temp.pgcascade_stage%'"
    )
    mid_apply = (
        "select count(*) from pg_stat_activity where datname = current_database() and state = 'active'"
        " and (query like 'merge into%' or query like 'with net as%')"
    )
    for what, query in (("mid-stream", mid_stream), ("mid-apply", mid_apply)):
        wait_until(lambda query=query: r.leaf.scalar(query), 120, interval=0.01, what=what)
        r.daemons.kill(worker)
        worker = r.start_worker(
            env={"PGCASCADE_PAUSE_AT": "applied-not-recorded", "PGCASCADE_PAUSE_MIN_EVENTS": str(n)}
        )
    paused = f"pause point applied-not-recorded (pid {worker.pid})"
    wait_until(lambda: paused in r.log(), 120, what=paused)
    r.daemons.kill(worker)
    with r.leaf.connect() as conn:
        assert conn.execute("select count(*) from accounts_audit").fetchone()[0] == 0
    r.start_worker()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    with r.leaf.connect() as conn:
        assert conn.execute("select count(*), count(distinct aid) from accounts_audit").fetchone() == (n, n)


def test_capture_follows_rotation_and_disable_insert(bench_replica):
    """The capture triggers write into the queue's current partition (built into them): every
    rotation under load regenerates them, and nothing is lost or applied twice; disable_insert
    makes them refuse changes at once, and they accept them again when it is cleared."""
    r = bench_replica
    with r.root.connect() as conn:
        conn.execute("select pgcascade.set_queue_config(%s, 'rotation_period', '0')", (r.queue,))
    r.start_ticker()  # maint_period 1 s: a rotation whenever every registration has passed a slot
    r.start_worker()
    r.wait_sync()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "12", "-R", "200")
    slots = set()
    while load.poll() is None:
        slots.add(
            r.root.scalar("select queue_cur_table from pgcascade.queue where queue_name = %s", (r.queue,))
        )
        time.sleep(0.2)
    assert load.returncode == 0, load.stderr.read()
    assert len(slots) == 3, f"the queue did not rotate through its 3 partitions: {slots}"
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)
    with r.root.connect() as conn:
        conn.execute("select pgcascade.set_queue_config(%s, 'disable_insert', 'true')", (r.queue,))
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="does not accept events"):
            conn.execute("update pgbench_branches set bbalance = bbalance + 1 where bid = 1")
        conn.execute("update pgbench_branches set bbalance = 0 where bid = -1")  # no row: passes
        conn.execute("select pgcascade.set_queue_config(%s, 'disable_insert', 'false')", (r.queue,))
        conn.execute("update pgbench_branches set bbalance = bbalance + 7 where bid = 1")
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)


@pytest.mark.parametrize("state", ["in-copy", "catching-up", "wanna-sync", "do-sync"])
def test_copy_process_sigkilled_in_each_state(bench_replica, state):
    r = bench_replica
    r.start_ticker()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "12", "-R", "200")
    pause = {"PGCASCADE_PAUSE_AT": state, "PGCASCADE_PAUSE_TABLE": "public.pgbench_history"}
    worker = r.start_worker(env={**pause, "PGCASCADE_PAUSE_SECONDS": "120"})

    def paused_pid() -> int | None:
        m = re.search(rf"pause point {state} \(pid (\d+)\)", r.log())
        return int(m.group(1)) if m else None

    wait_until(lambda: paused_pid() is not None, 60, what=f"a copy process paused in {state}")
    r.daemons.kill(worker)  # first the worker, so it cannot start another copy meanwhile
    os.kill(paused_pid(), signal.SIGKILL)
    r.start_worker()
    assert load.wait(timeout=60) == 0, load.stderr.read()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)


@pytest.mark.parametrize("between", ["off", "on"])
def test_provider_and_subscriber_crash_and_restart(bench_replica, between):
    """The root crashes, then the leaf - with commits its stopped WAL writer never wrote (a leaf
    commits without waiting for the flush), after the worker finished their batches on the root
    and reported its watermark - then the root again.  The root still has the ticks the leaf
    lost (its watermark counts only flushed commits), and every change is applied once.  Also
    with the leaf reading between ticks (read_between_ticks): its positions are durable on the
    root before it commits by them (the root's asynchronous commits and transaction ids)."""
    r = bench_replica
    r.ini("leaf", r.leaf, parallel_copies=2, watermark_period=0.1, read_between_ticks=between)
    r.start_ticker()
    worker = r.start_worker()
    for cluster in (r.root.cluster, r.leaf.cluster, r.root.cluster):
        if cluster is r.leaf.cluster:
            worker = crash_leaf_losing_commits(r, worker)
            continue
        load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "3")
        assert load.wait(timeout=60) == 0, load.stderr.read()
        cluster.restart("immediate")
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "2")
    assert load.wait(timeout=60) == 0, load.stderr.read()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)


def test_event_that_fails_stops_the_worker_until_fixed(replica):
    with replica.root.connect() as conn:
        conn.execute("create table t (id int primary key, v text)")
    with replica.leaf.connect() as conn:
        conn.execute("create table t (id int primary key, v int)")  # the wrong type
    replica.setup(["t"], leaf_args=("--force", "--expect-sync"))
    replica.start_ticker()
    worker = replica.start_worker()
    with replica.root.connect() as conn:
        conn.execute("insert into t values (1, '10'), (2, 'twenty')")

    def status() -> str:
        return replica.cli("leaf", "status").stdout

    wait_until(lambda: "last error" in status(), 30, what="the error in status")
    out = status()
    assert "t" in out and "invalid input syntax for type integer" in out, out
    assert "invalid input syntax for type integer" in replica.log()
    assert worker.poll() is None, "the worker must wait on the failed batch, not exit"
    with replica.leaf.connect() as conn:
        assert conn.execute("select count(*) from t").fetchone()[0] == 0  # nothing half-applied
        conn.execute("alter table t alter column v type text")
    replica.wait_sync(timeout=60)
    replica.assert_equal("t")
    assert "last error" not in status()


def test_copy_waits_for_a_queued_ddl_the_worker_has_not_run(replica):
    """A copy whose snapshot already holds a column that a queued EXECUTE adds on the subscriber
    would copy without it; the column's default would then replace the provider's values."""
    r = replica
    with r.root.connect() as conn:
        conn.execute("create table t (id int primary key, v text)")
    r.setup(["t"])
    with r.root.connect() as conn:
        conn.execute("insert into t values (1, 'before the ddl')")
    ddl = r.tmp / "ddl.sql"
    ddl.write_text("alter table t add column w int default 7;\n")
    r.cli("root", "execute", str(ddl))
    with r.root.connect() as conn:
        conn.execute("insert into t (id, v, w) values (2, 'after the ddl', 8)")
    r.start_ticker()
    # the worker holds the batch with the EXECUTE while the copy process starts
    r.start_worker(env={"PGCASCADE_PAUSE_AT": "execute", "PGCASCADE_PAUSE_SECONDS": "6"})
    wait_until(lambda: "pause point execute" in r.log(), 30, what="the worker paused before the DDL")
    r.wait_sync()
    r.assert_equal("t")
    assert r.leaf.scalar("select w from t where id = 2") == 8
    assert "waiting for the worker to run 1 queued DDL script" in r.log()


def test_pgbench_backlog_is_caught_up_in_merged_batches(bench_replica):
    r = bench_replica
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    r.daemons.close()  # stop everything, build a backlog, catch up
    r.start_ticker()
    load = pgbench(r.root, "-N", "-c", "2", "-j", "2", "-t", "3000")
    assert load.wait(timeout=120) == 0, load.stderr.read()
    r.start_worker()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)
    counts = [int(c) for c in re.findall(r"\{count: (\d+),", r.log())]
    assert max(counts) >= 6000, "a worker behind should apply several ticks per batch"


def leaf_ticks(r) -> tuple[int, dict[str, int | None]]:
    with r.leaf.connect() as conn:
        last = conn.execute("select last_tick from pgcascade.node").fetchone()[0]
        marks = dict(
            conn.execute("select table_name, applied_tick from pgcascade.subscriber_table").fetchall()
        )
    return last, marks


def test_parallel_apply_killed_between_lanes_and_node_applies_once(bench_replica):
    """apply_connections = 2: a backlog goes on two lanes, tables a foreign key joins on one.
    SIGKILLed after the lanes committed and before the node moved, the worker's restart applies
    the rest once; killed at random under load, nothing is lost or doubled; a batch holding a
    TRUNCATE between row events goes serially, in order."""
    r = bench_replica
    r.ini("leaf", r.leaf, apply_connections=2, parallel_apply_min_events=200)
    with r.leaf.connect() as conn:  # history and tellers must commit together
        conn.execute("alter table pgbench_history add foreign key (tid) references pgbench_tellers not valid")
    r.start_ticker()
    worker = r.start_worker()
    r.wait_sync()
    r.daemons.kill(worker)
    load = pgbench(r.root, "-N", "-c", "2", "-j", "2", "-t", "2000")
    assert load.wait(timeout=120) == 0, load.stderr.read()
    pause = {"PGCASCADE_PAUSE_AT": "lanes-committed", "PGCASCADE_PAUSE_MIN_EVENTS": "1000"}
    worker = r.start_worker(env={**pause, "PGCASCADE_PAUSE_SECONDS": "120"})
    wait_until(lambda: "pause point lanes-committed" in r.log(), 60, what="the lanes to commit")
    r.daemons.kill(worker)
    last, marks = leaf_ticks(r)
    ahead = {t for t, m in marks.items() if m is not None and m > last}
    assert {"public.pgbench_accounts", "public.pgbench_history"} <= ahead, (last, marks)
    lanes = re.findall(r"lane (\S+): \{count: (\d+)", r.log())
    assert len(lanes) >= 2 and all(int(n) > 0 for _, n in lanes[-2:]), lanes
    history_lane = next(tables for tables, _ in lanes[-2:] if "public.pgbench_history" in tables)
    assert "public.pgbench_tellers" in history_lane.split(","), lanes

    worker = r.start_worker()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)

    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "12", "-R", "400")
    rng = random.Random(11)
    for _ in range(8):
        time.sleep(rng.uniform(0.3, 1.2))
        r.daemons.kill(worker)
        time.sleep(rng.uniform(0.0, 0.6))  # a backlog: the restart takes it on two lanes
        worker = r.start_worker()
    assert load.wait(timeout=60) == 0, load.stderr.read()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)

    r.daemons.kill(worker)
    with r.root.connect() as conn:
        conn.execute("insert into pgbench_tellers select 1000 + i, 1, 0 from generate_series(1, 300) i")
        conn.execute("truncate pgbench_history")
        conn.execute("insert into pgbench_tellers select 2000 + i, 1, 0 from generate_series(1, 300) i")
    load = pgbench(r.root, "-N", "-c", "2", "-j", "2", "-t", "300")
    assert load.wait(timeout=60) == 0, load.stderr.read()
    before = len(r.log())
    r.start_worker()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    after = r.log()[before:]
    assert re.search(r"\{count: [1-9]\d{3,}", after) and "lane " not in after, after[-3000:]


def test_table_removed_on_the_root_leaves_the_subscriber(replica):
    with replica.root.connect() as conn:
        conn.execute("create table t1 (id int primary key)")
        conn.execute("create table t2 (id int primary key)")
        conn.execute("insert into t2 values (1)")
    replica.setup(["t1", "t2"])
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    replica.cli("root", "remove-table", "t2")
    with replica.root.connect() as conn:
        conn.execute("insert into t1 values (1)")
        conn.execute("insert into t2 values (2)")  # no longer captured
    replica.wait_sync()
    assert replica.cli("leaf", "tables").stdout.split() == ["public.t1", "ok"]
    replica.assert_equal("t1")
    with replica.leaf.connect() as conn:
        assert conn.execute("select array_agg(id) from t2").fetchone()[0] == [
            1
        ]  # the table and its rows stay
        conn.execute("insert into t2 values (3)")  # and it is an ordinary table again


def crash_leaf_losing_commits(r, worker):
    """A burst the leaf applies with its WAL writer stopped, then the leaf's crash (the WAL
    writer SIGKILLed: the postmaster restarts the cluster) once its watermark was reported and
    the root's maintenance ran behind it; the crash must take commits back - tried again when
    something else wrote the leaf's WAL meanwhile (the background writer or a checkpoint
    writing a page out writes the WAL before it, and the crash then loses nothing).  Returns
    the worker started again."""
    for _ in range(3):
        back, applied, worker = crash_leaf_once(r, worker)
        if back < applied:
            return worker
    pytest.fail(f"three crashes of the leaf took nothing back ({back} >= {applied}): the test proves nothing")


def crash_leaf_once(r, worker):
    """One burst and crash of crash_leaf_losing_commits: (the leaf's tick after the crash, the
    tick it had applied before, the worker started again)."""
    r.wait_sync()
    walwriter = stop_wal_writer(r.leaf)
    try:
        load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "2", "-R", "200")
        # halfway, one durable commit flushes the leaf's WAL so far: the batches applied until
        # then become durable (the watermark can name them), the rest of the burst is what the
        # crash takes back (with nothing else flushing the WAL, no watermark is ever reported)
        time.sleep(1)
        flush_wal(r.leaf)
        assert load.wait(timeout=60) == 0, load.stderr.read()
        r.wait_sync()
        applied = r.leaf.scalar("select last_tick from pgcascade.node")
        since = r.root.scalar("select now()")
        wait_until(lambda: _maintained_after(r, since), 60, what="a watermark report and the root's cleanup")
        r.daemons.kill(worker)
    finally:
        os.kill(walwriter, signal.SIGKILL)
    back = wait_until(lambda: _last_tick_after_restart(r), 60, what="the leaf back after its crash")
    return back, applied, r.start_worker()


def stop_wal_writer(db) -> int:
    """SIGSTOP the cluster's WAL writer (stop_while_idle): commits that do not wait for their
    flush stay unwritten until something flushes the WAL (flush_wal).  Its pid."""
    with db.connect() as conn:
        walwriter = conn.execute(
            "select pid from pg_stat_activity where backend_type = 'walwriter'"
        ).fetchone()[0]
        conn.execute("create table if not exists flush_mark (at timestamptz)")
    stop_while_idle(db, walwriter)
    return walwriter


def flush_wal(db) -> None:
    """One durable commit: the WAL written so far is flushed."""
    with db.connect() as conn:
        conn.execute("set synchronous_commit = on")
        conn.execute("insert into flush_mark values (now())")


def stop_while_idle(db, walwriter: int) -> None:
    """SIGSTOP the WAL writer while it waits for work: stopped amid a write, it would hold the
    lock every WAL flush takes, and the durable commit below (or any flush) would wait forever."""
    deadline = time.monotonic() + 30
    while True:
        os.kill(walwriter, signal.SIGSTOP)
        waiting = db.scalar("select wait_event from pg_stat_activity where pid = %s", (walwriter,))
        if waiting == "WalWriterMain":
            return
        os.kill(walwriter, signal.SIGCONT)
        assert time.monotonic() < deadline, f"the WAL writer never waited ({waiting})"
        time.sleep(0.01)


def _maintained_after(r, since) -> bool:
    """The leaf reported its watermark after `since`, the root's global watermark followed it
    and its tick cleanup ran up to there."""
    return r.root.scalar(
        "select w.reported > %s and g.sub_last_tick >= w.watermark"
        " and (select min(tick_id) from pgcascade.tick) >= g.sub_last_tick"
        " from pgcascade.node_watermark w,"  # the leaf's row: the root's only subscriber
        " pgcascade.subscription g join pgcascade.consumer c on c.co_id = g.sub_consumer"
        " where c.co_name = '.global_watermark'",
        (since,),
    )


def _last_tick_after_restart(r) -> int | None:
    try:
        return r.leaf.scalar("select last_tick from pgcascade.node")
    except psycopg.OperationalError:
        return None
