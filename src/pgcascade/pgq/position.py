"""A leaf's fetch between ticks: the SQL API of sql/pgq/53_position.sql (one call)."""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from pgcascade.core import roundtrip
from pgcascade.pgq.queue import BatchInfo, fetch_batch


def next_position_events(
    conn: psycopg.Connection,
    queue: str,
    consumer: str,
    *,
    finish: int | None,
    tick: int,
    position: str | None,
    land: bool,
    inline_events: int,
    seqs: list[str] | None = None,
    early: bool = False,
    meanwhile: Callable[[], None] | None = None,
    listen: float | None = None,
) -> BatchInfo:
    """One round trip: the batch after the consumer's record (`tick`, and `position` between
    ticks), read up to a snapshot taken now while the consumer is its queue's only reader and the
    batch comes inline, else - or with `land` - from a position to the first tick that covers
    it (sql/pgq/53_position.sql).  `finish`, `early`, `meanwhile`, `listen`: as in
    next_batch_events."""
    query = roundtrip.compose(
        conn,
        "select * from pgcascade.next_position_events(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            queue,
            consumer,
            finish,
            tick,
            position,
            land,
            inline_events,
            seqs,
            None if listen is None else round(listen * 1000),
        ),
    )
    return fetch_batch(conn, query, early, meanwhile)
