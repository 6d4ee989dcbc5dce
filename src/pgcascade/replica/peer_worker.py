"""A two-way master's apply of one batch of a peer's queue, in few round trips.

The same transaction as any batch (worker.py): the node row locked, the batch's events staged,
applied, the tick recorded - with what only a peer's batch has (the origin and whether to pass
the changes on, `pgcascade.peer_apply_begin`; the conflict policies; the peer's markers and this
master's own, `pgcascade.peer_batch_done`).  Statements that need no answer in between go in one
pipeline: on the subscriber, the batch costs BEGIN, one pipeline, the COPY of the events, the
barriers' look-up, one pipeline of the tables' statements (peer_apply.py), one of the
bookkeeping, and COMMIT.
"""

from __future__ import annotations

import psycopg

from pgcascade.core.errors import RuntimeFailure
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import BatchStats, TableApplier, apply_staged, stage_batch
from pgcascade.replica.conflicts import DEFAULT_POLICY
from pgcascade.replica.ddl import DdlReplay, await_origins
from pgcascade.replica.peer_apply import PeerBatch

# APPLY_SETTINGS in one statement (a pipeline takes one statement per call)
SETTINGS = "select set_config('session_replication_role', 'replica', true), set_config('synchronous_commit', 'on', true)"


def apply_batch(
    sub: psycopg.Connection,
    prov: psycopg.Connection,
    node: nodes.Node,
    info: BatchInfo,
    appliers: dict[str, TableApplier],
    prov_logical: bool,
) -> tuple[nodes.Node, BatchStats | None]:
    """Apply the peer's batch `info` in one transaction; returns the node row as locked, and the
    stats, or None when the batch does not start where this node's record says it is, or the
    node changed since the round began (nothing applied then)."""
    assert info.cur_tick_id is not None and node.peer_of is not None and node.provider_node is not None
    with sub.transaction():
        with sub.pipeline():
            sub.execute(SETTINGS)
            locked = nodes.locking_node(sub, node.queue_name)
            sub.execute("select pgcascade.peer_apply_begin(%s, %s)", (node.peer_of, node.provider_node))
            policies = sub.execute(subscriber.PEER_POLICIES, (node.queue_name,))
            seqs = sub.execute(subscriber_seqs.SEQS, (node.queue_name,))
        now = locked.fetchone()
        if now is None:
            raise psycopg.errors.NoDataFound(f"node row of {node.queue_name} is gone")
        if now.provider_node != node.provider_node or now.node_type != node.node_type:
            return now, None  # moved since this round began: start again
        if now.last_tick is not None and now.last_tick != info.prev_tick_id:
            return now, None
        peer = PeerBatch(
            node.queue_name,
            node.provider_node,
            node.node_name,
            node.peer_of,
            info.cur_tick_id,
            now.conflict_policy or DEFAULT_POLICY,
            dict(policies.fetchall()),
        )
        # what this master's marker tells its peers: the tick's snapshot (next_batch reads it
        # with its statement's snapshot, which a tick committed in the meantime is not in)
        snapshot = info.cur_tick_snapshot or q.tick_snapshot(prov, node.queue_name, info.cur_tick_id)
        if snapshot is None:
            raise RuntimeFailure(f"tick {info.cur_tick_id} of {node.queue_name} is gone from the queue")
        stage_batch(prov, sub, info, peer=True, peer_logical=prov_logical)
        await_origins(sub, node, info.cur_tick_id)
        stats = apply_staged(sub, appliers, queue=node.queue_name, peer=peer, ddl=DdlReplay(node).replay)
        with sub.pipeline():
            sub.execute(
                "select pgcascade.peer_batch_done(%s, %s, %s, %s, %s)",
                (node.peer_of, node.queue_name, peer.peer, info.cur_tick_id, snapshot),
            )
            nodes.record_applied(sub, node.queue_name, info.cur_tick_id)
        if seqs.fetchall():  # a peer's sequences are spread, not followed: none, as a rule
            subscriber_seqs.sync_sequences(prov, sub, node.queue_name)
    return now, stats
