"""Can a node that is about to become the root take the application's writes?

A subscriber applies the root's rows as they are; it needs no column defaults and leaves its
sequences where they are.  The application, once the node is the root, leaves key columns
out of its inserts and expects the defaults and sequences the old root had.  Before a
takeover we list what would break, per table the node holds in sync:

- a column with a default on the old root and none here (`add-table --create` makes none);
- a sequence a column draws from that is behind: behind the old root's value when the old
  root answers, else behind the largest value in its column here.  Sequences the node
  follows (`add-seq`) are moved up with every batch and are not checked.

Only the old root's definitions say what the application relies on; with the old root lost
(failover) only the sequences are checked.  A combined queue (merge-leaves feed it here) is
not checked: the application writes to the partitions.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from pgcascade.core import catalog
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber


def write_gaps(new: psycopg.Connection, old: psycopg.Connection | None, queue: str) -> list[str]:
    """What keeps `new` from taking the writes `old` (None: lost) takes; empty if nothing."""
    if nodes.is_combined(new, queue):
        return []  # a combined queue's rows come from its partitions' merge-leaves, not an application
    followed = {s for s, _ in subscriber_seqs.seqs(new, queue)}
    gaps: list[str] = []
    for table in sorted(subscriber.in_sync_tables(new, queue)):
        mine = catalog.column_defaults(new, table)
        theirs = catalog.column_defaults(old, table) if old and catalog.table_exists(old, table) else {}
        for col, d in theirs.items():
            here = mine.get(col)
            if (d.default or d.sequence) and here is not None and not (here.default or here.sequence):
                what = d.default or f"identity from {d.sequence}"
                gaps.append(f"{table}.{col} has no default here (the old root's: {what})")
        for col, d in mine.items():
            if d.sequence and d.sequence not in followed:
                behind = sequence_behind(new, old, table, col, d.sequence)
                if behind:
                    gaps.append(behind)
    return gaps


def sequence_behind(
    new: psycopg.Connection, old: psycopg.Connection | None, table: str, col: str, seq: str
) -> str | None:
    here = catalog.sequence_value(new, seq) or 0
    if old is not None and catalog.table_exists(old, seq):
        there = catalog.sequence_value(old, seq) or 0
        if here < there:
            return f"sequence {seq} ({table}.{col}) is at {here} here, {there} on the old root"
        return None
    top = scalar(new, sql.SQL("select max({})::text from {}").format(sql.Identifier(col), sql.SQL(table)))
    if top is not None and top.lstrip("-").isdigit() and here < int(top):
        return f"sequence {seq} is at {here}, behind {table}.{col} (up to {top})"
    return None


def refusal(gaps: list[str]) -> str:
    return (
        "the new root could not take the application's writes: "
        + "; ".join(gaps)
        + " (follow sequences with add-seq, make defaults with ALTER TABLE, or --force)"
    )
