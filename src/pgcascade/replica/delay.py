"""A delayed replica: a leaf that applies each batch only once its tick is `apply_delay` old.

The batch boundary is chosen by the provider's tick times (pgcascade.delayed_tick, PgQ's
next_batch_custom min_lag as a cap): the worker applies up to the newest tick that old, so the
leaf is always at a point in time of the set, one delay behind.  Between batches it sleeps until
the next tick is old enough (a loop_delay at most), not waking at every tick notified meanwhile.

The delay the worker runs with goes into its node row (`apply_delay`), where `status`,
`status --check` and `wait-sync` read it from any node.  A branch, a merge-leaf and a master
refuse it: they feed other nodes, which would be delayed too (docs/replication.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import psycopg

from pgcascade.core.config import JobConfig
from pgcascade.core.errors import ConfigError
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q

log = logging.getLogger("pgcascade.replay")


def refuse_apply_delay(cfg: JobConfig, node: nodes.Node) -> None:
    """apply_delay is for a leaf: a branch or merge-leaf would delay the nodes it feeds too, and a
    master's peers are no delayed replicas."""
    if cfg.worker.apply_delay and (
        node.node_type is not nodes.NodeType.LEAF or node.combined_queue or node.is_peer
    ):
        what = "merge-leaf" if node.combined_queue else "master" if node.is_peer else node.node_type.value
        raise ConfigError(
            f"{cfg.path}: apply_delay is for a leaf, and {node.node_name} is a {what} (its delay would"
            " hold back every node it feeds): remove it, or hang a delayed leaf under it"
        )


class ApplyDelay:
    """The worker's side of apply_delay: the cap of the next batch, and the sleep until it."""

    def __init__(self) -> None:
        self.due_in: float | None = None  # seconds until the next tick is old enough; None: no wait

    def check(self, cfg: JobConfig, sub: psycopg.Connection, node: nodes.Node) -> None:
        """Refuse a delay where it does not belong; publish the one the worker runs with."""
        self.due_in = None
        refuse_apply_delay(cfg, node)
        wanted = timedelta(seconds=cfg.worker.apply_delay) if cfg.worker.apply_delay else None
        if node.apply_delay != wanted:
            nodes.set_apply_delay(sub, node.queue_name, wanted)
            log.info("apply delay: %s", wanted or "none")

    def limit(
        self, cfg: JobConfig, prov: psycopg.Connection, node: nodes.Node, limit: int | None
    ) -> int | None:
        """The highest tick the next batch may reach: `limit`, and on a delayed leaf no tick
        younger than the delay (its last tick, which opens no batch, while none is that old)."""
        delay = cfg.worker.apply_delay
        if not delay:
            return limit
        due, self.due_in = q.delayed_tick(prov, node.queue_name, node.last_tick or 0, delay)
        due = due if due is not None else node.last_tick or 0
        return due if limit is None else min(due, limit)

    def sleep(self, prov: psycopg.Connection | None, most: float, interrupted: Callable[[], bool]) -> None:
        """Until the next tick is old enough, `most` seconds at most (a round also beats the
        daemon's heartbeat and reports its watermark): the ticks notified meanwhile are not old
        enough (they are drained after), and a stop or reload request cuts the sleep short."""
        assert self.due_in is not None
        deadline = time.monotonic() + min(max(self.due_in, 0.01), most)
        while not interrupted() and time.monotonic() < deadline:
            time.sleep(min(0.2, deadline - time.monotonic()))
        if prov is not None and not prov.closed:
            for _ in prov.notifies(timeout=0):
                pass
