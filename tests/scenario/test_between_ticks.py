"""A leaf that is its root's only reader reads between ticks (read_between_ticks on;
sql/pgq/53_position.sql): its
fetch writes nothing on the root, and its record is a snapshot of the root past its last tick.
Killed at any point, it loses and repeats nothing; a batch too large to come inline, a second
reader of the queue or a table to copy makes it land on a tick first.  Equality is an md5 of
every row computed by PostgreSQL; "applied once" is test_replication's audit trigger."""

from __future__ import annotations

import random
import time

from test_cascade import assert_history_applied_once, cascade  # noqa: F401
from test_replication import PGBENCH_TABLES, add_apply_audit, assert_applied_once, bench_replica, pgbench  # noqa: F401

from pgcascade.dev.localcluster import wait_until

POSITION = "select last_position from pgcascade.node"
TICKS = "select count(*) from pgcascade.tick"


def positions_seen(r, seconds: float) -> int:
    """How many of the leaf's records, read every 20 ms for `seconds`, were between two ticks."""
    seen, until = 0, time.monotonic() + seconds
    with r.leaf.connect() as conn:
        while time.monotonic() < until:
            seen += conn.execute(POSITION).fetchone()[0] is not None
            time.sleep(0.02)
    return seen


def test_a_leaf_reads_between_ticks_and_sigkills_lose_and_repeat_nothing(bench_replica):
    """Under pgbench the leaf's record is between ticks most of the time, and the root makes far
    fewer ticks than the leaf applies batches (the ticker's, not one a batch).  The worker is
    SIGKILLed right after a fetch, right after a commit and at random; a 5,000-row UPDATE (more
    than comes inline) lands on a tick and is applied by ticks; every table ends equal, each
    history row written once."""
    r = bench_replica
    r.ini("leaf", r.leaf, parallel_copies=2, read_between_ticks="on")
    r.start_ticker()
    worker = r.start_worker()
    r.wait_sync()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "16", "-R", "200")
    ticks = r.root.scalar(TICKS)
    assert positions_seen(r, 3) > 50
    batches = r.log().count("{count: ")
    time.sleep(2)
    batches, ticks = r.log().count("{count: ") - batches, r.root.scalar(TICKS) - ticks
    assert ticks * 2 < batches, f"{ticks} ticks for {batches} batches: the fetch ticked"
    for point in ("fetched", "applied"):
        r.daemons.kill(worker)
        worker = r.start_worker(env={"PGCASCADE_PAUSE_AT": point, "PGCASCADE_PAUSE_MIN_EVENTS": "1"})
        paused = f"pause point {point} (pid {worker.pid})"
        wait_until(lambda paused=paused: paused in r.log(), 60, what=paused)
    r.daemons.kill(worker)
    worker = r.start_worker()
    rng = random.Random(11)
    for _ in range(8):
        time.sleep(rng.uniform(0.1, 0.6))
        r.daemons.kill(worker)
        worker = r.start_worker()
    with r.root.connect() as conn:
        conn.execute("update pgbench_accounts set abalance = abalance + 1 where aid <= 5000")
    assert load.wait(timeout=60) == 0, load.stderr.read()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)


def test_a_second_reader_makes_the_leaf_land_and_keep_to_ticks(bench_replica):
    """Another consumer registered on the root's queue (what a branch joining the set does): the
    leaf lands on the next tick and reads by ticks while it is there, then between ticks again
    once it is gone."""
    r = bench_replica
    r.ini("leaf", r.leaf, parallel_copies=2, read_between_ticks="on")
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "40", "-R", "100")
    try:
        assert positions_seen(r, 2) > 10
        with r.root.connect() as conn:
            conn.execute("select pgcascade.register_consumer('rep', 'another')")
        wait_until(lambda: r.leaf.scalar(POSITION) is None, 30, what="the leaf on a tick")
        assert positions_seen(r, 3) == 0
        with r.root.connect() as conn:
            conn.execute("select pgcascade.unregister_consumer('rep', 'another')")
        wait_until(lambda: positions_seen(r, 0.5) > 0, 30, what="the leaf between ticks again")
    finally:
        load.kill()
        load.wait()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)


def test_by_default_every_batch_ends_on_a_tick(bench_replica):
    r = bench_replica
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "4", "-R", "200")
    assert positions_seen(r, 3) == 0
    assert load.wait(timeout=60) == 0, load.stderr.read()
    r.wait_sync()
    r.assert_equal(*PGBENCH_TABLES)


def test_a_leaf_between_ticks_moves_to_a_new_branch_only_once_landed(cascade, make_db):
    """A leaf stopped between ticks of its root: change-provider to a branch created after it is
    refused (the position means nothing on the branch); the leaf's worker, started again, sees
    the branch reading the root's queue, lands on a tick, and the move then goes through with
    nothing lost or applied twice."""
    c = cascade
    c.node("s1", make_db("a"))
    c.node("l", make_db("b"), read_between_ticks="on")
    c.node("s2", make_db("b"))
    c.pgbench_root("s1")
    c.create("l", "leaf", "s1")
    c.run("l", "add-table", "--all", "--create")
    add_apply_audit(c.dbs["l"])
    c.start_all("s1", "l")
    c.sync("s1", ["l"])
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "30", "-R", "100")
    try:
        wait_until(lambda: c.scalar("l", POSITION) is not None, 30, what="the leaf between ticks")
        while True:  # stopped between ticks
            c.kill_worker("l")
            if c.scalar("l", POSITION) is not None:
                break
            c.start_worker("l")
            time.sleep(0.3)
        c.create("s2", "branch", "s1")
        c.run("s2", "add-table", "--all", "--create")
        c.start_all("s2")
        c.sync("s1", ["s2"])
        # the race: the leaf knows the branch (its location comes in the queue) before its worker
        # has landed; here the leaf is given it as its next batch would
        with c.dbs["s1"].connect() as root, c.dbs["l"].connect() as leaf:
            row = root.execute(
                "select queue_name, node_name, node_location from pgcascade.node_location where node_name = 's2'"
            ).fetchone()
            leaf.execute(
                "insert into pgcascade.node_location (queue_name, node_name, node_location) values (%s, %s, %s)",
                row,
            )
        r = c.cli("l", "change-provider", "--provider", "s2", check=False)
        assert r.returncode == 1 and "between two ticks" in r.stderr, r.stderr
        c.start_worker("l")
        wait_until(lambda: c.scalar("l", POSITION) is None, 30, what="the leaf landed on a tick")
        c.cli("l", "change-provider", "--provider", "s2")
    finally:
        load.kill()
        load.wait()
    c.sync("s1", ["s2", "l"])
    c.assert_equal("s1", "l")
    assert_history_applied_once(c.dbs["l"])
