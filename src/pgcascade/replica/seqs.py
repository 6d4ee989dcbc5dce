"""The sequences a subscriber follows (subscriber_seq): each moves up to its provider's value
after every batch the worker applies, never down.  This module is the only one that reads or
writes subscriber_seq.
"""

from __future__ import annotations

import psycopg

from pgcascade.capture import tables as capture
from pgcascade.core import catalog
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import scalar

# a followed sequence moved up to a value, never down; one removed since the caller read the list
# (the worker reads it every watermark_period) is left alone
SETVAL = (
    "select setval(s.dest_seq::regclass, %s) from pgcascade.subscriber_seq s"
    " where s.queue_name = %s and s.dest_seq = %s and %s > coalesce(pg_sequence_last_value(s.dest_seq::regclass), 0)"
)
SEQS = "select seq_name, dest_seq from pgcascade.subscriber_seq where queue_name = %s order by 1"


def seqs(conn: psycopg.Connection, queue: str) -> list[tuple[str, str]]:
    return conn.execute(SEQS, (queue,)).fetchall()


def add_seqs(
    conn: psycopg.Connection, prov: psycopg.Connection, queue: str, names: list[str], all_seqs: bool
) -> list[str]:
    provided = capture.set_seqs(prov, queue)
    wanted = provided if all_seqs else [catalog.canonical(prov, n) for n in names]
    for s in wanted:
        if s not in provided:
            raise UserError(f"sequence {s} is not replicated by the provider: add it on the root first")
        if scalar(conn, "select to_regclass(%s) is null", (s,)):
            raise UserError(f"sequence {s} does not exist on the subscriber")
    with conn.transaction():
        follow_seqs(conn, queue, wanted)
    return wanted


def remove_seqs(conn: psycopg.Connection, queue: str, names: list[str]) -> None:
    for n in names:
        cur = conn.execute(
            "delete from pgcascade.subscriber_seq where queue_name = %s and seq_name = %s",
            (queue, catalog.canonical(conn, n)),
        )
        if cur.rowcount == 0:
            raise UserError(f"sequence {n!r} is not replicated here")


def follow_seqs(conn: psycopg.Connection, queue: str, names: list[str]) -> None:
    """Follow these sequences of the set under their own names."""
    for name in names:
        conn.execute(
            "insert into pgcascade.subscriber_seq (queue_name, seq_name, dest_seq) values (%s, %s, %s)"
            " on conflict do nothing",
            (queue, name, name),
        )


def forget_all(conn: psycopg.Connection, queue: str) -> None:
    """The node stops replicating (release_all): it follows no sequence of the set any more."""
    conn.execute("delete from pgcascade.subscriber_seq where queue_name = %s", (queue,))


def sync_sequences(prov: psycopg.Connection, sub: psycopg.Connection, queue: str) -> None:
    """Move each followed sequence up to the provider's value (never down)."""
    followed = seqs(sub, queue)
    if not followed:
        return
    values = prov.execute(
        "select pg_sequence_last_value(s::regclass) from unnest(%s::text[]) with ordinality u(s, o) order by o",
        ([s for s, _ in followed],),
    ).fetchall()
    set_values(sub, queue, followed, [v for (v,) in values])


def set_values(
    sub: psycopg.Connection, queue: str, followed: list[tuple[str, str]], values: list[int | None] | None
) -> None:
    """Move each followed sequence (provider's name, ours) up to the provider's value, never down."""
    for (_seq, dest), value in zip(followed, values or [], strict=False):
        if value is not None:
            sub.execute(SETVAL, (value, queue, dest, value))
