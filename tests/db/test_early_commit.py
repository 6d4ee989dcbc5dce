"""A statement whose result comes back before its commit is done (roundtrip.send_early, the
worker's fetch): the commit's outcome is read by settle, and the connection is as before."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psycopg
import pytest

from pgcascade.core import roundtrip
from pgcascade.pgq import queue as q

Q = "earlyq"


def test_the_result_comes_first_and_the_commit_is_settled_after(db):
    """The row a statement wrote is committed once settle returns (another session sees it),
    and the session goes on as a plain one: its next statements run in transactions of their
    own."""
    with db.connect() as conn, db.connect() as other:
        conn.execute("create table t (i int primary key)")
        result = roundtrip.send_early(conn, b"insert into t values (1) returning i")
        assert roundtrip.load_rows(conn, result) == [(1,)]
        roundtrip.settle(conn)
        assert roundtrip.committed(conn)
        assert other.execute("select count(*) from t").fetchone()[0] == 1
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.execute("insert into t values (2)")
        assert other.execute("select count(*) from t").fetchone()[0] == 2


def test_a_failed_statement_raises_and_commits_nothing(db):
    with db.connect() as conn, db.connect() as other:
        conn.execute("create table t (i int primary key)")
        conn.execute("insert into t values (1)")
        with pytest.raises(psycopg.errors.UniqueViolation):
            roundtrip.send_early(conn, b"insert into t values (2), (1) returning i")
        assert roundtrip.committed(conn)
        assert other.execute("select count(*) from t").fetchone()[0] == 1
        assert conn.execute("select count(*) from t").fetchone()[0] == 1


def test_an_early_fetch_opens_the_batch_its_commit_makes_durable(db):
    """q.next_batch_events with `early`: the batch's events come back, the tick it made and
    the open batch are the provider's once settled; an empty fetch is settled at once."""
    with db.connect() as conn, db.connect() as other:
        q.create_queue(conn, Q)
        q.register_consumer(conn, Q, "c1")
        q.insert_event(conn, Q, "t", "a")
        fetch = dict(finish=None, max_events=None, max_tick=None, inline_events=100, early=True)
        info = q.next_batch_events(conn, Q, "c1", **fetch)
        assert info.batch_id is not None and info.events is not None and '"a"' in info.events
        roundtrip.settle(conn)
        assert other.execute("select max(tick_id) from pgcascade.tick").fetchone()[0] == info.cur_tick_id
        assert q.next_batch_events(conn, Q, "c1", **{**fetch, "finish": info.batch_id}).batch_id is None
        assert roundtrip.committed(conn)  # nothing left pending
        assert conn.execute("select 1").fetchone() == (1,)


class CutShort(BaseException):
    """What a daemon's SIGTERM handler raises (SystemExit), raised here by a timer."""


def test_a_wait_for_the_commit_cut_short_closes_the_session(db):
    """A signal that ends settle's wait for the commit (a daemon's SIGTERM) leaves the session
    closed: a statement sent on it half-read would wait forever for its result (a worker's
    shutdown hung so, finishing its batch).  Settling again is a no-op."""
    with db.connect() as conn:
        conn.execute("create table t (i int)")
        conn.execute(
            "create function slow_commit() returns trigger language plpgsql as"
            " $$ begin perform pg_sleep(2); return null; end $$"
        )
        conn.execute(
            "create constraint trigger slow after insert on t deferrable initially deferred"
            " for each row execute function slow_commit()"
        )
        result = roundtrip.send_early(conn, b"insert into t values (1) returning i")
        assert roundtrip.load_rows(conn, result) == [(1,)]

        def cut_short(_sig, _frame):
            raise CutShort

        old = signal.signal(signal.SIGALRM, cut_short)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            with pytest.raises(CutShort):
                roundtrip.settle(conn)  # the commit runs the deferred trigger's 2 s sleep
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert conn.closed
        roundtrip.settle(conn)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")


class Beats:
    """A thread that notes the time every 10 ms: whether it ran while the test's thread waited."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.beat, daemon=True)
        self.thread.start()

    def beat(self) -> None:
        while not self.stop.wait(0.01):
            self.times.append(time.monotonic())

    def since(self, start: float) -> int:
        return len([b for b in self.times if start < b < time.monotonic()])

    def end(self) -> None:
        self.stop.set()
        self.thread.join()


def test_other_threads_run_while_a_round_trip_waits_for_the_server(db):
    """A worker's round trips wait for their server without holding Python's lock: a fetch
    ahead in a thread (replica/ahead.py) and the apply beside it each go on while the other
    waits.  Each call here keeps the server busy half a second; a thread beside it must run."""

    calls = {
        "send": lambda conn, _: roundtrip.send(conn, b"select pg_sleep(0.5)"),
        "send_early": lambda conn, _: roundtrip.send_early(conn, b"select pg_sleep(0.5)"),
        "relay_copy": lambda conn, dst: roundtrip.relay_copy(
            conn, b"copy (select pg_sleep(0.5)) to stdout", dst, b"copy t from stdin"
        ),
    }
    beats = Beats()
    try:
        with db.connect() as conn, db.connect() as dst:
            dst.execute("create table t (v text)")
            for name, call in calls.items():
                start = time.monotonic()
                call(conn, dst)
                roundtrip.settle(conn)
                during = beats.since(start)
                assert during >= 20, f"{name}: the other thread ran {during} times in 0.5 s"
    finally:
        beats.end()


def test_other_threads_run_while_a_large_message_waits_to_be_sent(db):
    """Sending waits without Python's lock too: a message larger than the socket's buffers, to a
    server that does not read it for half a second (its backend stopped, then continued by a
    shell: a thread of this process could not run), lets a thread beside it run meanwhile."""
    literal = b"x" * (48 << 20)
    beats = Beats()
    try:
        with db.connect() as conn:
            for name, call in {
                "send": lambda: roundtrip.send(conn, b"select length('" + literal + b"')")[0],
                "send_early": lambda: roundtrip.send_early(conn, b"select length('" + literal + b"')"),
            }.items():
                pid = conn.info.backend_pid
                os.kill(pid, signal.SIGSTOP)
                cont = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -CONT {pid}"])
                start = time.monotonic()
                result = call()
                roundtrip.settle(conn)
                cont.wait()
                assert roundtrip.load_rows(conn, result) == [(len(literal),)]
                during = beats.since(start)
                assert during >= 20, (
                    f"{name}: the other thread ran {during} times while the server did not read"
                )
    finally:
        beats.end()
