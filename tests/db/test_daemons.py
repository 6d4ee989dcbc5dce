"""One daemon per node and role, and a daemon that stopped is visible: a second worker for a
leaf (another ini, another pidfile) and a second ticker for a database are refused at once in
one line naming the first; the first keeps replicating; a worker killed with SIGKILL is shown
by `status`, `status --json` and `status --check` (critical) at once, and the second can start
then.  A worker whose lock's session is ended takes the lock again and goes on.  A killed
ticker makes the root's check critical."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

from conftest import table_checksum

from pgcascade.dev.localcluster import wait_until


def write(db, first: int, last: int) -> None:
    with db.connect() as conn:
        conn.execute(
            "insert into public.t select i, 'v' || i from generate_series(%s::int, %s::int) i", (first, last)
        )


def worker_entry(replica) -> dict:
    report = json.loads(replica.cli("leaf", "status", "--json").stdout)
    return next(d for d in report["daemons"] if d["role"] == "worker")


def test_a_second_worker_is_refused_and_a_killed_one_is_critical_at_once(replica, cli, daemons):
    with replica.root.connect() as conn:
        conn.execute("create table public.t (id int primary key, v text)")
    write(replica.root, 1, 100)
    replica.setup(["public.t"])
    ticker = replica.start_ticker()
    first = replica.start_worker()
    replica.wait_sync(60)

    # another ini and pidfile for the same leaf: refused at once, naming the first
    second_ini = replica.ini("leaf_again", replica.leaf)
    started = time.monotonic()
    r = cli(second_ini, "worker", timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert time.monotonic() - started < 15
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.startswith("pgcascade: a worker for set rep in this database runs already: ")
    assert f"pid {first.pid} on {socket.gethostname()}, job leaf ({replica.leaf_ini})" in line, line
    # -d too: refused before it detaches, so the refusal is seen
    r = cli(second_ini, "worker", "-d", timeout=60)
    assert r.returncode == 1 and "runs already" in r.stderr, r.stdout + r.stderr
    # a second ticker for the root's database likewise
    ticker2 = replica.ini("ticker_again", replica.root)
    r = cli("ticker", ticker2, timeout=60)
    assert r.returncode == 1 and "a ticker for this database runs already: pid " in r.stderr, r.stderr

    # the first keeps replicating
    write(replica.root, 101, 200)
    replica.wait_sync(60)
    assert first.poll() is None
    assert table_checksum(replica.root, "public.t") == table_checksum(replica.leaf, "public.t")
    ok = replica.cli("leaf", "status", "--check")
    assert ok.returncode == 0, ok.stdout
    entry = worker_entry(replica)
    assert entry["running"] is True and entry["pid"] == first.pid and entry["critical"] is False

    # SIGKILL: critical at once, the worker named, status says when it was last seen
    daemons.kill(first, signal.SIGKILL)
    wait_until(
        lambda: replica.cli("leaf", "status", "--check", check=False).returncode == 2,
        10,
        what="status --check to turn critical",
    )
    crit = replica.cli("leaf", "status", "--check", check=False).stdout
    assert crit.startswith("CRITICAL leaf1 (leaf): worker not running (last seen "), crit
    entry = worker_entry(replica)
    assert entry["running"] is False and entry["critical"] is True and entry["stopped"] is None
    assert entry["pid"] == first.pid and entry["last_seen_seconds"] < 30
    assert "worker: not running (last seen " in replica.cli("leaf", "status").stdout

    # the second starts now, replicates what was written meanwhile, and is running
    write(replica.root, 201, 300)
    second = daemons.start(str(second_ini), "worker")
    replica.wait_sync(60)
    assert table_checksum(replica.root, "public.t") == table_checksum(replica.leaf, "public.t")
    entry = worker_entry(replica)
    assert entry["running"] is True and entry["pid"] == second.pid and entry["job"] == "leaf_again"

    # its lock's session ended by the server: it takes the lock again and goes on
    with replica.leaf.connect() as conn:
        assert conn.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity where application_name = %s",
            ("pgcascade worker leaf_again",),
        ).fetchall() == [(True,)]
    write(replica.root, 301, 400)
    replica.wait_sync(60)
    wait_until(lambda: "worker lock of set rep" in replica.log("leaf_again"), 10, what="the lock taken again")
    assert second.poll() is None and worker_entry(replica)["running"] is True
    assert table_checksum(replica.root, "public.t") == table_checksum(replica.leaf, "public.t")

    # the root's ticker killed: the root's check names it (a root's worker is not needed)
    assert replica.cli("root", "status", "--check").returncode == 0
    daemons.kill(ticker, signal.SIGKILL)
    crit = replica.cli("root", "status", "--check", check=False)
    assert crit.returncode == 2 and crit.stdout.startswith("CRITICAL root (root): ticker not running"), (
        crit.stdout
    )


def cpu_seconds(pid: int) -> float:
    """User and system CPU of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_paused_worker_sleeps_through_writes_and_a_resume_wakes_it(replica):
    """Paused, the worker waits for nothing but a resume: no round at each tick or commit of
    the root (it spun on them: 0.8 s of CPU in these 3 s, 0.0 now), and with a loop_delay of a
    minute the resume alone brings the changes."""
    replica.ini("leaf", replica.leaf, loop_delay=60)
    with replica.root.connect() as conn:
        conn.execute("create table public.t (id int primary key, v text)")
    write(replica.root, 1, 100)
    replica.setup(["public.t"])
    replica.start_ticker()
    worker = replica.start_worker()
    replica.wait_sync(60)
    replica.cli("leaf", "pause")
    time.sleep(1)  # the round in flight ends
    before = cpu_seconds(worker.pid)
    with replica.root.connect(autocommit=True) as conn:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # one commit (and a tick) after another
            conn.execute("update public.t set v = v || '.' where id = 1")
    spent = cpu_seconds(worker.pid) - before
    assert spent < 0.2, f"the paused worker used {spent:.2f} s of CPU in 3 s of writes"
    assert replica.leaf.scalar("select v from public.t where id = 1") == "v1", "applied while paused"
    replica.cli("leaf", "resume")
    wait_until(
        lambda: table_checksum(replica.root, "public.t") == table_checksum(replica.leaf, "public.t"), 15
    )


def test_a_pause_stops_a_leaf_that_applies_batch_after_batch(replica):
    """A worker applying batch after batch sees its node paused within moments: a batch reads
    the node again only once what its round started from is FRESH_SECONDS / 2 old (and the
    rounds start from that for at most FRESH_SECONDS), so nothing is applied a fraction of a
    second after `pause` returned while the root's row goes on changing; a resume brings the
    rest.  (The node's watermark report, an event of its own, would make a batch go the general
    way, which reads the node again: reported once a minute here.)"""
    replica.ini("leaf", replica.leaf, watermark_period=60)
    with replica.root.connect() as conn:
        conn.execute("create table public.t (id int primary key, v int)")
        conn.execute("insert into public.t values (1, 0)")
    replica.setup(["public.t"])
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync(60)
    value = "select v from public.t where id = 1"
    stop = threading.Event()

    def bump() -> None:  # one commit after another: a batch after another on the leaf
        with replica.root.connect(autocommit=True) as conn:
            while not stop.is_set():
                conn.execute("update public.t set v = v + 1 where id = 1")

    writer = threading.Thread(target=bump)
    writer.start()
    try:
        wait_until(lambda: replica.leaf.scalar(value) > 300, 30, what="batches applied on the leaf")
        replica.cli("leaf", "pause")
        time.sleep(0.5)  # the batch in flight, and the node read at most FRESH_SECONDS before
        seen, root_then = replica.leaf.scalar(value), replica.root.scalar(value)
        time.sleep(1)
        assert replica.root.scalar(value) > root_then, "the root's row stopped changing"
        assert replica.leaf.scalar(value) == seen, "the leaf applied batches after its pause"
    finally:
        stop.set()
        writer.join()
    replica.cli("leaf", "resume")
    wait_until(lambda: replica.leaf.scalar(value) == replica.root.scalar(value), 15, what="the resume")


def test_the_ticker_sleeps_while_a_consumer_keeps_the_queue_ticked_and_ticks_once_it_stops(replica):
    """While something else ticks a queue on demand (a worker, here the test), the ticker asks
    only when a tick could be due - once the last is ticker_max_lag old - not every
    ticker_period; once nothing else ticks, it ticks the events that wait within that lag."""
    replica.setup()
    with replica.root.connect() as conn:
        queue = conn.execute("select queue_name from pgcascade.queue").fetchone()[0]
        conn.execute("select pgcascade.set_queue_config(%s, 'ticker_max_lag', '400 ms')", (queue,))
        conn.execute(f'alter database "{replica.root.name}" set track_functions = pl')
    ticker = replica.start_ticker()
    started = time.monotonic()
    stop = threading.Event()

    def tick_on_demand() -> None:  # an event and a tick every 10 ms, as a busy worker asks
        with replica.root.connect() as conn:
            while not stop.wait(0.01):
                conn.execute("select pgcascade.insert_event(%s, 'x', 'y')", (queue,))
                conn.execute("select pgcascade.ticker(%s)", (queue,))

    thread = threading.Thread(target=tick_on_demand)
    thread.start()
    try:
        time.sleep(3)
    finally:
        stop.set()
        thread.join()
    last_tick = "select max(tick_id) from pgcascade.tick"
    with replica.root.connect() as conn:
        ticked = conn.execute(last_tick).fetchone()[0]
        conn.execute("select pgcascade.insert_event(%s, 'x', 'waits')", (queue,))
        wait_until(lambda: conn.execute(last_tick).fetchone()[0] > ticked, 5, what="the ticker's tick")
    replica.daemons.kill(ticker, signal.SIGTERM)  # its session ends: its counts reach the statistics
    seconds = time.monotonic() - started
    with replica.root.connect() as conn:
        rounds = wait_until(
            lambda: conn.execute(
                "select calls from pg_stat_user_functions where funcname = 'ticker_round'"
            ).fetchone(),
            10,
            what="the ticker's rounds in the statistics",
        )[0]
    # every ticker_period (20 ms) would be ~50 a second; every 400 ms, or 250 ms at the most, ~3
    assert rounds < 8 * seconds, f"{rounds} rounds in {seconds:.1f} s"
