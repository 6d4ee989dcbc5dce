"""Positions between ticks (sql/pgq/53_position.sql) on a real server: a consumer that follows
its position from fetch to fetch gets every committed event once - a transaction open across
several positions included - and a tick whose snapshot predates a position is never taken as
covering it.  Expected events are those the test committed itself."""

from __future__ import annotations

import json

import psycopg

from pgcascade.pgq import position
from pgcascade.pgq import queue as q

Q = "posq"


def fetch(conn: psycopg.Connection, tick: int, pos: str | None, land: bool = False) -> q.BatchInfo:
    info = position.next_position_events(
        conn, Q, "c1", finish=None, tick=tick, position=pos, land=land, inline_events=100
    )
    return info


def follow(conn: psycopg.Connection, tick: int, pos: str | None) -> tuple[list[str], int, str | None]:
    """Fetch to positions until nothing is new: the events' data, and the record after them."""
    got: list[str] = []
    while True:
        info = fetch(conn, tick, pos)
        if info.batch_id is None:
            return got, tick, pos
        assert info.prev_tick_id == tick and info.prev_position == pos
        got += [e[3] for e in json.loads(info.events or "[]")]
        assert info.cur_tick_id is not None
        tick, pos = info.cur_tick_id, info.cur_position


def test_every_committed_event_comes_once_across_positions(db):
    with db.connect() as conn, db.connect(autocommit=False) as long_tx:
        q.create_queue(conn, Q)
        q.register_consumer(conn, Q, "c1")
        tick = q.last_tick_id(conn, Q)
        assert tick is not None
        long_ids = [q.insert_event(long_tx, Q, "long", f"l{i}") for i in range(3)]
        q.insert_event(conn, Q, "short", "s0")
        got, tick, pos = follow(conn, tick, None)
        assert got == ["s0"] and pos is not None  # between ticks: the ticker made none
        assert q.last_tick_id(conn, Q) == tick
        q.insert_event(conn, Q, "short", "s1")
        long_tx.commit()
        more, tick, pos = follow(conn, tick, pos)
        assert sorted(more) == ["l0", "l1", "l2", "s1"], long_ids
        again, _, _ = follow(conn, tick, pos)
        assert again == []


def test_a_tick_taken_before_a_position_does_not_cover_it(db):
    with db.connect() as conn, db.connect(autocommit=False) as ticker:
        q.create_queue(conn, Q)
        q.register_consumer(conn, Q, "c1")
        tick = q.last_tick_id(conn, Q)
        assert tick is not None
        # a tick's snapshot is taken now, its commit comes after the position below
        ticker.execute("select pgcascade.ticker(%s)", (Q,))
        q.insert_event(conn, Q, "short", "s0")
        got, tick, pos = follow(conn, tick, None)
        assert got == ["s0"] and pos is not None
        ticker.commit()
        newest = q.last_tick_id(conn, Q)
        assert newest is not None and newest > tick
        covers = conn.execute(
            "select pgcascade.snapshot_covers(tick_snapshot, %s::pg_snapshot) from pgcascade.tick"
            " where tick_id = %s",
            (pos, newest),
        ).fetchone()[0]
        assert covers is False
        # nothing new, yet no empty batch to that tick; a landing makes a tick that covers it
        assert fetch(conn, tick, pos).batch_id is None
        landing = fetch(conn, tick, pos, land=True)
        assert landing.batch_id and landing.cur_tick_id is not None and landing.cur_tick_id > newest
        rows = conn.execute(landing.event_sql or "").fetchall()
        assert rows == []  # s0 is applied already: not in the batch to the tick
