"""A two-way peer's TRUNCATE, applied so that masters converge (docs/two-way.md, "TRUNCATE").

A TRUNCATE is a delete of every row the truncating master held, with one version (its commit
time and master) kept as the table's tombstone (`pgcascade.table_truncate`).  Applied from a
peer, it removes the rows that peer had seen; a row it had not seen is a conflict
(update/truncate) that the table's policy decides, as an update against a delete.  The server
does it (`pgcascade.apply_peer_truncate`, sql/replica/94_two_way_truncate.sql); this module
passes it the policy's winner expression, which replica/conflicts.py decides.
"""

from __future__ import annotations

from typing import Protocol

import psycopg
from psycopg import sql

from pgcascade.core.pgconn import scalar
from pgcascade.replica.conflicts import ConflictPolicy, winner_sql


class Peer(Protocol):
    """What is applied of whom (a replica.apply.PeerBatch)."""

    @property
    def queue(self) -> str: ...
    @property
    def peer(self) -> str: ...
    @property
    def me(self) -> str: ...
    @property
    def tick(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def policies(self) -> dict[str, str]: ...


def apply_peer_truncate(
    sub: psycopg.Connection, table: str, dest: str, keys: list[str], ev_id: int, peer: Peer
) -> int:
    """Apply the peer's TRUNCATE of `table` (staged event `ev_id`) to `dest`; conflicts found."""
    policy = peer.policies.get(table, peer.policy)
    winner = winner_sql(ConflictPolicy.parse(policy), sql.Literal(peer.peer), sql.Literal(table))
    return int(
        scalar(
            sub,
            "select pgcascade.apply_peer_truncate(%s, %s, %s, %s, %s::regclass, %s, %s, %s, %s, %s)",
            (
                peer.queue,
                peer.peer,
                peer.me,
                table,
                dest,
                keys,
                ev_id,
                peer.tick,
                policy,
                winner.as_string(sub),
            ),
        )
    )
