"""The ticker daemon as a real process: ticks by thresholds, maintenance, crashes and restarts
of the ticker and of the database, several databases, and daemon control (-d/-s/-k/-r).

Every test starts `python -m pgcascade ticker CONFIG` and checks what a user would check: the
events a consumer receives, the queue's state in the database, the daemon's log and exit codes.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest
from conftest import PGCASCADE

from pgcascade.core import schema
from pgcascade.core.daemon import pid_alive, read_pid
from pgcascade.dev.localcluster import wait_until
from pgcascade.pgq import queue as q
from pgcascade.pgq.consumer import Batch, Consumer

# --- helpers --------------------------------------------------------------------------------------


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def logfile_of(cfg: Path) -> Path:
    return cfg.with_suffix(".log")  # write_config puts logfile next to the ini, named after the job


def last_tick(connstr: str, queue: str) -> int:
    with psycopg.connect(connstr, autocommit=True) as conn:
        return q.queue_info(conn, queue)[0]["last_tick_id"]


def cur_table(connstr: str, queue: str) -> int:
    with psycopg.connect(connstr, autocommit=True) as conn:
        return q.queue_info(conn, queue)[0]["queue_cur_table"]


def pending_events(connstr: str, queue: str, consumer: str) -> int:
    with psycopg.connect(connstr, autocommit=True) as conn:
        return q.consumer_info(conn, queue, consumer)[0]["pending_events"]


def setup_queue(connstr: str, queue: str, consumers: tuple[str, ...] = ("c",), **settings: object) -> None:
    with psycopg.connect(connstr, autocommit=True) as conn:
        q.create_queue(conn, queue)
        for k, v in settings.items():
            q.set_queue_config(conn, queue, k, v)
        for c in consumers:
            q.register_consumer(conn, queue, c)


def insert(connstr: str, queue: str, *datas: str) -> list[int]:
    """Insert events in one transaction; returns their ids once committed."""
    with psycopg.connect(connstr) as conn:
        ids = [q.insert_event(conn, queue, "t", d) for d in datas]
    return ids


def take_batches(connstr: str, queue: str, consumer: str) -> list[list[dict]]:
    """Consume with PgQ's SQL calls (next_batch, get_batch_events, finish_batch) until no batch is ready."""
    batches = []
    with psycopg.connect(connstr, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        while True:
            batch_id = conn.execute("select pgcascade.next_batch(%s, %s) as b", (queue, consumer)).fetchone()[
                "b"
            ]
            if batch_id is None:
                return batches
            events = conn.execute("select * from pgcascade.get_batch_events(%s)", (batch_id,)).fetchall()
            conn.execute("select pgcascade.finish_batch(%s)", (batch_id,))
            batches.append(events)


def ids_of(batches: list[list[dict]]) -> list[int]:
    return [e["ev_id"] for b in batches for e in b]


class Collector:
    """Consume until `ids` covers `want`; keeps every event received (to spot duplicates)."""

    def __init__(self, connstr: str, queue: str, consumer: str = "c"):
        self.connstr, self.queue, self.consumer = connstr, queue, consumer
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        got = [e for b in take_batches(self.connstr, self.queue, self.consumer) for e in b]
        self.events += got
        return got

    def wait_for(self, want: list[int], timeout: float = 10.0) -> None:
        def covered() -> bool:
            self.poll()
            return set(want) <= {e["ev_id"] for e in self.events}

        wait_until(covered, timeout, interval=0.05, what=f"events {want} on {self.queue}/{self.consumer}")

    @property
    def ids(self) -> list[int]:
        return [e["ev_id"] for e in self.events]


def ticker_config(write_config, job: str, **keys: object) -> Path:
    keys.setdefault("ticker_period", 0.05)
    return write_config(job, **keys)


def wait_ticks(connstr: str, queue: str, n: int, timeout: float = 10.0) -> int:
    """Wait until `queue` has made `n` more ticks; returns the new last tick."""
    start = last_tick(connstr, queue)
    wait_until(lambda: last_tick(connstr, queue) >= start + n, timeout, what=f"{n} ticks on {queue}")
    return last_tick(connstr, queue)


# --- 1. ticks by thresholds ---------------------------------------------------------------------------


def test_ticker_ticks_by_thresholds_idle_period_and_pause(db, write_config, daemons):
    cs = db.connstr
    # `thr` ticks only on its event count; `clock` ticks every 200 ms and shows the ticker's rounds.
    setup_queue(cs, "thr", ticker_max_count=5, ticker_max_lag="1 hour", ticker_idle_period="1 hour")
    setup_queue(cs, "clock", ticker_idle_period="200 ms")
    setup_queue(cs, "paused", ticker_idle_period="200 ms", ticker_paused="true")
    thr0, paused0 = last_tick(cs, "thr"), last_tick(cs, "paused")

    ticker = daemons.start("ticker", ticker_config(write_config, "tick1", db=cs))

    # 4 events: below ticker_max_count, so no tick while the ticker makes several rounds
    ids = insert(cs, "thr", "e1", "e2", "e3", "e4")
    wait_ticks(cs, "clock", 3)
    assert last_tick(cs, "thr") == thr0, "a tick below ticker_max_count and ticker_max_lag"
    assert take_batches(cs, "thr", "c") == []

    # the 5th event reaches ticker_max_count: one tick, one batch with exactly the 5 events
    # (inserted while the queue is paused: a tick made between its numbering and its commit
    # would leave it to a later batch, and no threshold would make that one)
    with db.connect() as conn:
        q.set_queue_config(conn, "thr", "ticker_paused", "true")
    ids += insert(cs, "thr", "e5")
    with db.connect() as conn:
        q.set_queue_config(conn, "thr", "ticker_paused", "false")
    wait_until(lambda: last_tick(cs, "thr") > thr0, 10, what="a tick on thr at ticker_max_count")
    batches = take_batches(cs, "thr", "c")
    assert ids_of(batches) == ids
    assert [e["ev_data"] for e in batches[0]] == ["e1", "e2", "e3", "e4", "e5"]
    assert len(batches) == 1

    # ticker_max_lag: one event waiting longer than the lag makes a tick too
    with db.connect() as conn:
        q.set_queue_config(conn, "thr", "ticker_max_count", 1000)
        q.set_queue_config(conn, "thr", "ticker_max_lag", "300 ms")
    t1 = last_tick(cs, "thr")
    lag_id = insert(cs, "thr", "late")
    wait_until(lambda: last_tick(cs, "thr") > t1, 10, what="a tick on thr after ticker_max_lag")
    assert ids_of(take_batches(cs, "thr", "c")) == lag_id

    # idle ticks: `clock` has no events and ticks every ~200 ms (the default idle period is 1 s)
    c0 = last_tick(cs, "clock")
    wait_until(lambda: last_tick(cs, "clock") >= c0 + 5, 4.0, what="5 idle ticks on clock within 4 s")
    gaps = db.scalar(
        "select min(t2.tick_time - t1.tick_time) from pgcascade.tick t1 join pgcascade.tick t2"
        " on t2.tick_queue = t1.tick_queue and t2.tick_id = t1.tick_id + 1"
        " join pgcascade.queue q on q.queue_id = t1.tick_queue where q.queue_name = 'clock' and t1.tick_id > %s",
        (c0,),
    )
    assert gaps.total_seconds() >= 0.15, f"idle ticks closer than ticker_idle_period: {gaps}"

    # the paused queue got no tick at all, not even with events waiting
    paused_ids = insert(cs, "paused", "p1")
    wait_ticks(cs, "clock", 3)
    assert last_tick(cs, "paused") == paused0
    assert take_batches(cs, "paused", "c") == []

    # unpaused, it ticks and the event arrives
    with db.connect() as conn:
        q.set_queue_config(conn, "paused", "ticker_paused", "false")
    Collector(cs, "paused").wait_for(paused_ids)
    assert ticker.poll() is None


# --- 2. maintenance: rotation and retry ------------------------------------------------------------


def test_rotation_waits_for_the_consumer_and_is_logged(db, write_config, daemons):
    cs = db.connstr
    setup_queue(cs, "q", rotation_period="0")
    # `spin` has nobody registered, so it rotates at every maintenance round: the log's count of
    # its rotations tells how many rounds the daemon made.
    setup_queue(cs, "spin", consumers=(), rotation_period="0")
    ids = insert(cs, "q", *[f"d{i}" for i in range(10)])  # into event table 0, unread by c
    assert cur_table(cs, "q") == 0

    cfg = ticker_config(write_config, "rot", db=cs, maint_period=0.2)
    log = logfile_of(cfg)
    daemons.start("ticker", cfg)

    def spin_rounds() -> int:
        return read_log(log).count("maint_rotate_tables(spin): 1")

    # the empty tables 1 and 2 are rotated into; table 0 holds events c has not read
    wait_until(lambda: cur_table(cs, "q") == 2, 10, what="q to rotate to table 2")
    wait_until(lambda: read_log(log).count("maint_rotate_tables(q): 1") == 2, 10, what="2 rotations logged")
    rounds = spin_rounds()
    wait_until(lambda: spin_rounds() >= rounds + 4, 10, what="4 more maintenance rounds")
    assert cur_table(cs, "q") == 2, "rotated into (and truncated) a table with unread events"

    # every event is still there for c; once c has read them, rotation goes on
    batches = take_batches(cs, "q", "c")
    assert ids_of(batches) == ids
    assert [e["ev_data"] for b in batches for e in b] == [f"d{i}" for i in range(10)]
    wait_until(lambda: cur_table(cs, "q") != 2, 10, what="rotation after the consumer passed everything")
    # the daemon logs a rotation just after its commit: poll for the line, too
    wait_until(lambda: read_log(log).count("maint_rotate_tables(q): 1") >= 3, 10, what="the rotation logged")
    # nothing delivered twice after the rotations; a batch may come, empty: the queue's idle
    # period (1 s) passes while the rotation is polled for on a loaded machine
    assert ids_of(take_batches(cs, "q", "c")) == []


def test_retried_event_comes_back_to_its_consumer_only(db, write_config, daemons):
    cs = db.connstr
    setup_queue(cs, "q", consumers=("c1", "c2"))
    e1, e2 = insert(cs, "q", "one", "two")

    cfg = ticker_config(write_config, "retry", db=cs, retry_period=0.2)
    log = logfile_of(cfg)
    daemons.start("ticker", cfg)

    # c1 takes the batch, asks for e1 again at once, finishes
    with db.connect() as conn:
        wait_until(
            lambda: conn.execute("select pgcascade.next_batch('q', 'c1')").fetchone()[0] is not None,
            10,
            what="a batch for c1",
        )
        batch = conn.execute("select pgcascade.next_batch('q', 'c1')").fetchone()[0]
        evs = conn.execute("select ev_id, ev_retry from pgcascade.get_batch_events(%s)", (batch,)).fetchall()
        assert evs == [(e1, None), (e2, None)]
        conn.execute("select pgcascade.event_retry(%s::int8, %s::int8, 0::int4)", (batch, e1))
        conn.execute("select pgcascade.finish_batch(%s)", (batch,))
    # c2 consumes normally
    c2 = Collector(cs, "q", "c2")
    c2.wait_for([e1, e2])

    # the daemon moves e1 back; c1 gets it again, with ev_retry = 1 and its data
    c1 = Collector(cs, "q", "c1")
    c1.wait_for([e1])
    assert [(e["ev_id"], e["ev_retry"], e["ev_data"]) for e in c1.events] == [(e1, 1, "one")]
    assert "maint_retry_events: 1 events back" in read_log(log)

    # c2, caught up past the tick that brought e1 back to c1, does not get it again
    back_tick = last_tick(cs, "q")
    wait_until(lambda: last_tick(cs, "q") > back_tick, 10, what="a tick after the retry")
    c2.poll()
    assert c2.ids == [e1, e2]
    with db.connect() as conn:
        assert q.consumer_info(conn, "q", "c2")[0]["last_tick"] >= back_tick
    assert db.scalar("select count(*) from pgcascade.retry_queue") == 0


# --- 3. SIGKILL of the ticker under load -------------------------------------------------------------


class Writers:
    """Threads inserting events in transactions (some rolled back); `committed` holds what committed."""

    def __init__(self, connstr: str, queue: str, n: int = 4):
        self.connstr, self.queue = connstr, queue
        self.committed: list[int] = []
        self.rolled_back: list[int] = []
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]

    def run(self, seed: int) -> None:
        rnd = random.Random(seed)
        try:
            with psycopg.connect(self.connstr) as conn:
                while not self.stopping.is_set():
                    ids = [q.insert_event(conn, self.queue, "w", str(seed)) for _ in range(rnd.randint(1, 5))]
                    if rnd.random() < 0.15:
                        conn.rollback()
                        with self.lock:
                            self.rolled_back += ids
                    else:
                        conn.commit()
                        with self.lock:
                            self.committed += ids
                    time.sleep(rnd.random() * 0.004)  # pacing only
        except BaseException as e:
            self.errors.append(e)

    def count(self) -> int:
        with self.lock:
            return len(self.committed)

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=30)


class ConsumerThread(Consumer):
    def __init__(self, connstr: str, queue: str, consumer: str):
        super().__init__(connstr, queue, consumer)
        self.ids: list[int] = []
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def process_batch(self, batch: Batch) -> None:
        self._pending = [ev.ev_id for ev in batch.events()]

    def loop(self) -> None:
        try:
            while not self.stopping:
                if self.run_once() is None:
                    self.wait_for_tick(0.2)
                    continue
                with self.lock:  # the batch is finished: count its events once
                    self.ids += self._pending
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.close()

    def consumed(self) -> list[int]:
        with self.lock:
            return list(self.ids)


def test_ticker_sigkill_and_restart_delivers_every_event_exactly_once(db, write_config, daemons):
    cs = db.connstr
    # many small ticks, rotations and retries-pass: kills land in every kind of transaction
    setup_queue(
        cs, "q", ticker_max_count=20, ticker_max_lag="20 ms", ticker_idle_period="100 ms", rotation_period="0"
    )
    cfg = ticker_config(write_config, "kill", db=cs, ticker_period=0.01, maint_period=0.05, retry_period=0.05)
    consumer = ConsumerThread(cs, "q", "c")
    consumer.thread.start()
    rnd = random.Random(7)
    try:
        with Writers(cs, "q") as writers:
            for round_no in range(6):
                p = daemons.start("ticker", cfg)
                if round_no == 0:
                    # killed while starting up
                    time.sleep(rnd.random() * 0.5)
                else:
                    wait_ticks(cs, "q", rnd.randint(1, 15), timeout=20)
                os.kill(p.pid, signal.SIGKILL)
                assert p.wait(timeout=10) == -signal.SIGKILL
                # writers go on while no ticker runs
                n = writers.count()
                wait_until(lambda n=n: writers.count() >= n + 50, 20, what="writes while the ticker is down")
            final = daemons.start("ticker", cfg)
            wait_ticks(cs, "q", 5, timeout=20)
        assert not writers.errors, writers.errors
        committed = list(writers.committed)
        assert len(committed) > 300

        def all_consumed() -> bool:
            return set(committed) <= set(consumer.consumed())

        wait_until(all_consumed, 30, what=f"the {len(committed)} committed events to be consumed")
        # one more tick after everything: nothing arrives twice, late or out of nowhere
        wait_ticks(cs, "q", 2)
        wait_until(lambda: pending_events(cs, "q", "c") == 0, 10, what="the consumer to reach the last tick")
    finally:
        consumer.stop()
        consumer.thread.join(timeout=30)
    assert not consumer.errors, consumer.errors
    got = consumer.consumed()
    dups = sorted({i for i in got if got.count(i) > 1})
    assert not dups, f"events delivered more than once: {dups[:20]}"
    assert not set(got) & set(writers.rolled_back), "rolled-back events delivered"
    assert sorted(got) == sorted(committed)
    assert final.poll() is None


# --- 4. database restart ------------------------------------------------------------------------------


def test_ticker_reconnects_after_database_restart(private_cluster, write_config, daemons):
    cs = private_cluster.create_database("app")
    with psycopg.connect(cs, autocommit=True) as conn:
        schema.install(conn)
        # the cluster runs with synchronous_commit off; a crash must not take back what we checked
        conn.execute("alter database app set synchronous_commit = on")
    setup_queue(cs, "q")
    cfg = ticker_config(write_config, "dbrestart", db=cs, maint_period=0.2, retry_period=0.2)
    log = logfile_of(cfg)
    ticker = daemons.start("ticker", cfg)

    consumer = Collector(cs, "q")
    before = insert(cs, "q", "before")
    consumer.wait_for(before)

    private_cluster.stop("immediate")
    wait_until(
        lambda: "db app: " in read_log(log) and "retrying" in read_log(log), 10, what="the ticker to notice"
    )
    private_cluster.start()

    after = insert(cs, "q", "after1", "after2")
    wait_until(lambda: "db app: connected again" in read_log(log), 20, what="the ticker to reconnect")
    consumer.wait_for(after, timeout=20)
    assert consumer.ids == before + after
    assert [e["ev_data"] for e in consumer.events] == ["before", "after1", "after2"]
    assert ticker.poll() is None, "the ticker exited"
    # and it keeps ticking
    wait_ticks(cs, "q", 2)
    assert ticker.poll() is None
    assert "Traceback" not in read_log(log)


# --- 5. several databases -------------------------------------------------------------------------------


def test_ticker_serves_database_list(make_db, write_config, daemons):
    dbs = [make_db(installed=True), make_db(installed=True)]
    port = dbs[0].cluster.port
    for d in dbs:
        setup_queue(d.connstr, "q")
    cfg = ticker_config(
        write_config,
        "multi",
        base_connstr=f"host=127.0.0.1 port={port} user=postgres",
        database_list=", ".join(d.name for d in dbs),
    )
    ticker = daemons.start("ticker", cfg)
    for d in dbs:
        ids = insert(d.connstr, "q", f"in {d.name}")
        c = Collector(d.connstr, "q")
        c.wait_for(ids)
        assert [e["ev_data"] for e in c.events] == [f"in {d.name}"]
        assert f"db {d.name}: serving" in read_log(logfile_of(cfg))
    assert ticker.poll() is None


def test_ticker_discovers_databases_with_pgcascade(private_cluster, write_config, daemons):
    pc = private_cluster
    for name in ("has_a", "has_b"):
        with psycopg.connect(pc.create_database(name), autocommit=True) as conn:
            schema.install(conn)
        setup_queue(pc.connstr(name), "q")
    pc.create_database("plain")
    cfg = ticker_config(
        write_config,
        "discover",
        base_connstr=f"host=127.0.0.1 port={pc.port} user=postgres",
        discover_period=0.5,
    )
    log = logfile_of(cfg)
    ticker = daemons.start("ticker", cfg)

    for name in ("has_a", "has_b"):
        ids = insert(pc.connstr(name), "q", name)
        Collector(pc.connstr(name), "q").wait_for(ids)
    served = set(re.findall(r"db (\w+): serving", read_log(log)))
    assert served == {"has_a", "has_b"}

    # a database that gets pgcascade later is served from the next discovery on
    with psycopg.connect(pc.connstr("plain"), autocommit=True) as conn:
        schema.install(conn)
    setup_queue(pc.connstr("plain"), "q")
    ids = insert(pc.connstr("plain"), "q", "late")
    Collector(pc.connstr("plain"), "q").wait_for(ids)
    assert "db plain: serving" in read_log(log)

    # a dropped database is no longer served, the others still are
    pc.drop_database("has_b")
    wait_until(
        lambda: "db has_b: no longer served" in read_log(log), 10, what="has_b to be dropped from service"
    )
    ids = insert(pc.connstr("has_a"), "q", "still")
    Collector(pc.connstr("has_a"), "q").wait_for(ids)
    assert ticker.poll() is None


def test_reload_rereads_the_config(make_db, write_config, daemons, cli):
    d1, d2 = make_db(installed=True), make_db(installed=True)
    for d in (d1, d2):
        setup_queue(d.connstr, "q", ticker_idle_period="100 ms")
    base = f"host=127.0.0.1 port={d1.cluster.port} user=postgres"
    cfg = ticker_config(write_config, "reload", base_connstr=base, database_list=d1.name)
    log = logfile_of(cfg)
    daemons.start("ticker", cfg)
    wait_ticks(d1.connstr, "q", 3, timeout=30)  # a daemon just started: its interpreter's start included
    t2 = last_tick(d2.connstr, "q")
    wait_ticks(d1.connstr, "q", 3)
    assert last_tick(d2.connstr, "q") == t2, "a database not in database_list was ticked"

    cfg = ticker_config(write_config, "reload", base_connstr=base, database_list=f"{d1.name}, {d2.name}")
    r = cli("ticker", cfg, "-r")
    assert r.returncode == 0, r.stderr
    assert "reload sent" in r.stdout
    wait_until(lambda: "reloading config" in read_log(log), 10, what="the reload to be logged")
    ids = insert(d2.connstr, "q", "after reload")
    Collector(d2.connstr, "q").wait_for(ids)
    assert f"db {d2.name}: serving" in read_log(log)


# --- 6. daemon control ------------------------------------------------------------------------------------


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    assert "Traceback" not in text
    return lines[0]


@pytest.fixture
def kill_detached():
    """Pidfiles of detached daemons: whatever is still running at the end is killed by its pid."""
    pidfiles: list[Path] = []
    yield pidfiles
    for pf in pidfiles:
        pid = read_pid(pf)
        if pid is not None and pid_alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_detach_stop_reload_and_refusals(db, write_config, cli, kill_detached, tmp_path):
    setup_queue(db.connstr, "q", ticker_idle_period="100 ms")
    cfg = ticker_config(write_config, "ctl", db=db.connstr)
    pidfile, log = tmp_path / "ctl.pid", tmp_path / "ctl.log"
    kill_detached.append(pidfile)

    # -d returns at once; the daemon writes its pidfile and ticks
    r = cli("ticker", cfg, "-d", timeout=30)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: read_pid(pidfile) is not None, 10, what="the pidfile")
    pid = read_pid(pidfile)
    assert pid_alive(pid)
    wait_ticks(db.connstr, "q", 3)
    assert f"starting (pid {pid})" in read_log(log)

    # a second copy is refused, in the foreground and detached alike
    for args in (("ticker", cfg), ("ticker", cfg, "-d")):
        r = cli(*args, timeout=30)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "already running" in one_line(r.stderr)
        assert r.stdout == ""
    assert read_pid(pidfile) == pid and pid_alive(pid)

    # -r: reload
    r = cli("ticker", cfg, "-r")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: "reloading" in read_log(log), 10, what="the reload log line")
    wait_ticks(db.connstr, "q", 2)  # still working after the reload

    # -s: stop; the pidfile goes, the process ends
    r = cli("ticker", cfg, "-s")
    assert r.returncode == 0, r.stderr
    assert "stop sent" in r.stdout
    assert not pidfile.exists()
    wait_until(lambda: not pid_alive(pid), 10, what=f"pid {pid} to end")
    assert "ticker ctl stopped" in read_log(log)

    # -s with nothing running
    r = cli("ticker", cfg, "-s")
    assert r.returncode == 1
    assert "not running" in one_line(r.stderr)

    # and it starts again after a stop
    r = cli("ticker", cfg, "-d", timeout=30)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: read_pid(pidfile) not in (None, pid), 10, what="the new pidfile")
    assert pid_alive(read_pid(pidfile))
    r = cli("ticker", cfg, "-s")
    assert r.returncode == 0, r.stderr


def test_stop_and_kill_of_a_foreground_ticker(db, write_config, cli, daemons, tmp_path):
    setup_queue(db.connstr, "q", ticker_idle_period="100 ms")
    cfg = ticker_config(write_config, "fg", db=db.connstr)
    pidfile = tmp_path / "fg.pid"

    # -s: graceful stop; exit code 0, pidfile removed (the process is a child of ours: its
    # exit leaves a zombie until we reap it, which must not count as still running)
    p = daemons.start("ticker", cfg)
    wait_until(lambda: read_pid(pidfile) == p.pid, 10, what="the pidfile")
    wait_ticks(db.connstr, "q", 2)
    started = time.monotonic()
    r = cli("ticker", cfg, "-s")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - started < 15
    assert p.wait(timeout=10) == 0
    assert not pidfile.exists()

    # a stale pidfile (SIGKILL leaves it) does not block the next start
    p = daemons.start("ticker", cfg)
    wait_until(lambda: read_pid(pidfile) == p.pid, 10, what="the pidfile")
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    assert read_pid(pidfile) == p.pid

    # -k: kill now
    p = daemons.start("ticker", cfg)
    wait_until(lambda: read_pid(pidfile) == p.pid, 10, what="the pidfile of the restarted ticker")
    wait_ticks(db.connstr, "q", 2)
    r = cli("ticker", cfg, "-k")
    assert r.returncode == 0, r.stderr
    assert p.wait(timeout=10) == 1
    assert not pidfile.exists()
    assert "kill requested" in read_log(tmp_path / "fg.log")


def test_detach_needs_logfile_and_pidfile(db, write_config, cli):
    cfg = ticker_config(write_config, "nolog", db=db.connstr, logfile="")
    r = cli("ticker", cfg, "-d", timeout=30)
    assert r.returncode == 2
    assert "-d needs logfile and pidfile" in one_line(r.stderr)


def test_a_stop_request_as_soon_as_the_pidfile_names_the_daemon_is_not_lost(db, write_config, tmp_path):
    """A shell starts background jobs with SIGINT ignored.  A daemon so started, asked to stop
    (`-s` sends SIGINT to the pid in the pidfile) the moment its pidfile appears, still stops:
    the pidfile is written only once the daemon's own handler is in place."""
    setup_queue(db.connstr, "q")
    cfg = ticker_config(write_config, "bg", db=db.connstr)
    pidfile = tmp_path / "bg.pid"
    for _ in range(5):
        p = subprocess.Popen(
            [*PGCASCADE, "ticker", str(cfg)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        try:
            deadline = time.monotonic() + 30
            while read_pid(pidfile) != p.pid and time.monotonic() < deadline:
                time.sleep(0.002)
            os.kill(p.pid, signal.SIGINT)
            assert p.wait(timeout=15) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert not pidfile.exists()
