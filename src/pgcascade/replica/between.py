"""When a leaf reads its provider between ticks (sql/pgq/53_position.sql).

A leaf that keeps up fetches the changes committed up to its fetch - read by the snapshot of the
fetch's statement, nothing written on the provider - and records that snapshot as its position
with the batch (apply_begin).  It does so only while nothing needs its batches to end at ticks:
a plain leaf (no delay, no merge, not a peer) with every table ok and no tick cap, the only reader
of its provider's queue, and not behind.  Otherwise it keeps to ticks (next_batch_events), and
a position it holds lands on the next tick first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from pgcascade.pgq import node as nodes
from pgcascade.pgq import position
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import tables as subscriber

# after the provider said another node reads its queue: ticks only, asked again after this long
KEEP_TO_TICKS = 10.0


@dataclass
class BetweenTicks:
    """A worker's choice between reading to a position and reading to ticks."""

    enabled: bool  # the worker setting read_between_ticks
    ticks_until: float = 0.0  # keep to ticks until then (another reader was seen)
    behind: bool = False  # the last batch was too large to come inline: catch up by ticks

    def reads_to_now(
        self,
        node: nodes.Node,
        tables: list[subscriber.SubscriberTable],
        max_tick: int | None,
        commits_async: bool,
    ) -> bool:
        """Whether this round's batch may end between ticks."""
        return (
            self.enabled
            and commits_async
            and node.node_type is nodes.NodeType.LEAF
            and node.last_tick is not None
            and not node.is_peer
            and not node.combined_queue
            and node.apply_delay is None
            and max_tick is None
            and not self.behind
            and time.monotonic() >= self.ticks_until
            and all(t.state.is_ok for t in tables)
        )

    def fetch(
        self,
        prov: psycopg.Connection,
        queue: str,
        node: nodes.Node,
        finish: int | None,
        to_now: bool,
        inline_events: int,
        seqs: list[str] | None,
        meanwhile: Callable[[], None],
        listen: float | None,
    ) -> BatchInfo:
        """The batch after the node's record, up to now (`to_now`) or landing on a tick."""
        assert node.last_tick is not None
        return position.next_position_events(
            prov,
            queue,
            node.consumer,
            finish=finish,
            tick=node.last_tick,
            position=node.last_position,
            land=not to_now,
            inline_events=inline_events,
            seqs=seqs,
            early=True,  # (a leaf commits asynchronously: its batch is applied meanwhile)
            meanwhile=meanwhile,
            listen=listen,
        )

    def fetched(self, info: BatchInfo) -> None:
        """What a fetch (of either kind) says about the next rounds."""
        if info.alone is False:
            self.ticks_until = time.monotonic() + KEEP_TO_TICKS
        # behind: the position fetch said so, or a batch too large to come inline (a fetch
        # that finds nothing or a batch inline says it caught up)
        self.behind = bool(info.by_ticks) or (info.batch_id is not None and info.event_sql is not None)
