"""A two-way master's worker loop over its peers: a worker per peer subscription, in the
master's process (worker.py), each asking its peer's queue only when it is worth asking.

A peer that makes its ticks on demand (trigger capture) is asked like a root by a one-way
worker: again soon after a batch, less often while nothing comes, and once idle its doorbell
is rung so the peer's next commit notifies; a peer that ticks on its own (logical capture)
notifies its ticks and is asked anyway every PEER_IDLE_POLL.  The master reads its node and
its peers once every PEER_IDLE_POLL (and after an error), not at every round.
"""

from __future__ import annotations

import logging
import selectors
import time
from typing import TYPE_CHECKING

import psycopg

from pgcascade.core.config import JobConfig
from pgcascade.pgq import node as nodes
from pgcascade.replica.ddl import PeerBehind

log = logging.getLogger("pgcascade.replay")

PEER_IDLE_POLL = 1.0  # a caught-up peer's queue is asked at least this often without a tick
# a peer's batch of more than PEER_SPACED_EVENTS events applied (the load rose; the peer's own
# events, not all its queue numbered: those it holds for others doubled the count of two masters
# at 200 tps, and spaced every batch after a slow one) is followed by no tick on demand for
# PEER_TICK_SPACING times its time, so the batches' fixed cost never takes the whole worker: two
# masters flat out 1,670 tps with no spacing, 2,100-2,180 with it, the same as with the ticker
# alone; small batches are not spaced (lag at 200 tps a master 17 -> 14 ms).  Four times, not
# two (session 25, four 20-s runs each, alternating): flat out 1,860 -> 2,026 tps, lag median at
# 200 tps the same (14.5 / 15.1 ms), its p95 24 -> 25-39 ms, flat out 50-60 -> 70-75
PEER_TICK_SPACING = 4.0
PEER_SPACED_EVENTS = 16


class PeerLoop:
    """A master's rounds over its peers; the worker provides these."""

    cfg: JobConfig
    queue: str
    prov: psycopg.Connection | None
    peer_workers: dict[str, PeerLoop]
    peer_ticked: bool
    ask_at: float
    peers_until: float
    retry_at: float
    backoff: float
    single_ticks_until: float

    if TYPE_CHECKING:  # the worker's own (declared here, never defined: they would shadow them)

        def drop_connections(self) -> None: ...
        def notified(self, timeout: float = 0.0) -> bool: ...
        def report_error(self, e: Exception) -> None: ...
        def peer_worker(self, queue: str) -> PeerLoop: ...
        def rings(self) -> bool: ...
        def listen(self, seconds: float) -> float: ...
        def work(self) -> bool: ...
        def shutdown(self) -> None: ...
        def flush_stats(self) -> None: ...
        def reload(self) -> None: ...

    def sleep_on_peers(self, seconds: float) -> None:
        """A master: wait until a peer's queue is worth asking again (peer_is_idle) or notifies,
        at most `seconds`; each peer worker whose queue notified is marked (peer_ticked).  A peer
        that makes its ticks on demand and had no changes for a while gets its doorbell rung."""
        ws = [w for w in self.peer_workers.values() if w.prov is not None and not w.prov.closed]
        try:
            if self.peers_ticked(ws):  # ticks that came in during the last round's statements
                return
            now = time.monotonic()
            for w in ws:
                if w.rings():
                    w.ask_at = now + w.listen(seconds)
            with selectors.DefaultSelector() as sel:
                for w in ws:
                    assert w.prov is not None
                    sel.register(w.prov.fileno(), selectors.EVENT_READ)
                if ws:
                    sel.select(max(0.0, min([seconds, *(w.ask_at - now for w in ws)])))
                    self.peers_ticked(ws)
                    return
        except psycopg.Error:
            self.drop_connections()
        time.sleep(seconds)

    @staticmethod
    def peers_ticked(ws: list[PeerLoop]) -> bool:
        """Mark the peer workers whose queue ticked (notified); whether any did."""
        for w in ws:
            w.peer_ticked = w.notified() or w.peer_ticked
        return any(w.peer_ticked for w in ws)

    def peer_is_idle(self) -> bool:
        """A peer worker not due (ask_at: its poll delay, or the spacing of its ticks on demand)
        whose queue has not notified since its last ask (a tick, or a commit ringing its
        doorbell): asking costs a round trip to the peer and reads here, for nothing.  A peer
        that ticks on its own is asked anyway every PEER_IDLE_POLL (a notification lost with a
        connection)."""
        if self.prov is None or self.prov.closed or time.monotonic() >= self.ask_at:
            return False
        try:
            return not (self.peer_ticked or self.notified())
        except psycopg.Error:
            return False

    def work_peers(self, sub: psycopg.Connection, subscribed: set[str] | None) -> bool:
        """A master replays each of its peers' queues in turn (`subscribed`, or those its node
        has: read again every PEER_IDLE_POLL, and after an error); one peer's failure (its
        error is in its node row) holds back that peer only."""
        if subscribed is None:
            subscribed = {p.queue_name for p in nodes.peers(sub, self.queue)}
            self.peers_until = time.monotonic() + PEER_IDLE_POLL
        for queue in set(self.peer_workers) - subscribed:
            self.peer_workers.pop(queue).shutdown()
        for queue in sorted(subscribed - set(self.peer_workers)):
            self.peer_workers[queue] = self.peer_worker(queue)
        busy = False
        for queue, w in self.peer_workers.items():
            if time.monotonic() < w.retry_at or w.peer_is_idle():
                continue
            w.peer_ticked = False
            try:
                busy = w.work() or busy
                w.backoff = 0.0
            except PeerBehind as e:  # not an error: another master's DDL comes first; tick by tick
                w.retry_at, w.single_ticks_until = time.monotonic() + 0.5, e.batch_end  # (no deadlock)
                log.info("peer queue %s: %s", queue, e)
            except psycopg.OperationalError as e:
                if (e.sqlstate or "").startswith("40"):
                    # a deadlock with a local transaction, or one that changed a row the batch
                    # was judged against: rolled back, applied again at once (still open)
                    log.info(
                        "peer queue %s: %s; applying the batch again", queue, str(e).strip().splitlines()[0]
                    )
                    busy = True
                    continue
                w.drop_connections()
                w.fail(e, queue)
                self.peers_until = 0.0
            except Exception as e:  # the peer's batch failed: the others go on
                w.fail(e, queue)
                self.peers_until = 0.0
        return busy

    def fail(self, e: Exception, queue: str) -> None:
        self.backoff = min(max(self.backoff * 2, 1.0), 30.0)
        self.retry_at = time.monotonic() + self.backoff
        log.error("peer queue %s: %s (retrying in %.0fs)", queue, str(e).strip(), self.backoff)
        self.report_error(e)
