"""How a caught-up worker (one-way, or a master's for each peer) waits for changes where its
provider ticks on demand.

After a batch it asks again at once; a fetch that finds nothing is asked again after a poll
delay that doubles while nothing comes, and from LISTEN_AFTER on the worker rings the queue's
doorbell (05_doorbell.sql: producers notify while it rings) and sleeps on LISTEN - ringing in the
fetch that found nothing where it can (a one-way worker: next_batch_events' `listen_ms`), not
in a round trip of its own after it.
"""

from __future__ import annotations

import select
import time

import psycopg

from pgcascade.pgq import queue as q

# a fetch that found nothing is asked again after twice POLL_MIN, doubling while nothing comes
# (from LISTEN_AFTER on, the worker sleeps on LISTEN): 1 ms after the last batch, not 2, took the
# lag from 7.7 to 7.5 ms at 500 tps and from 7.7 to 7.2 at 2,000 (alternate runs; path_cpu.py:
# the provider's CPU +7%, the worker's less, with its notification wait no longer spinning)
POLL_MIN, POLL_MAX = 0.0005, 0.05
# a caught-up worker whose provider ticks on demand sleeps on LISTEN this long, doubling while
# idle, and its doorbell rings as long: after a wake-up the writers' commits stop notifying
# within LISTEN_MIN (each notifying commit holds a cluster-wide lock through its WAL flush).  A
# commit after the doorbell ran out and before the next ring is seen by that ring (pending).
LISTEN_MIN, LISTEN_MAX = 0.002, 1.0
# ...once its poll delay reached this: after its first empty answer.  A worker that keeps
# finding changes asks again at once and rings nobody (a doorbell rung after every batch made
# every commit notify, and the notifying commits queued behind each other's WAL flushes: W1
# 0.45 of no replication against 0.53).  A one-way worker waited ~15 ms without changes until
# session 38; at 1 ms (path_cpu.py, alternated pairs) the lag at 500 tps 8.3 -> 8.0 ms (mean of
# six medians), p95 13.6 -> 13.2, at 2,000 tps and under W1's load the same (three pairs
# each).  A peer worker waited ~3 ms: at 1 ms two masters at 200 tps a master 12.7 -> 11.9 ms
# (six alternated runs of two_way_bench.py, flat out within the noise)
LISTEN_AFTER = 0.001


def notified(conn: psycopg.Connection, queue: str, timeout: float = 0.0, wakes_only: bool = False) -> bool:
    """Whether a tick of `queue`, a producer ringing its doorbell or a wake notified on `conn`
    (within `timeout`; `wakes_only`: a wake alone counts); takes every notification received
    so far (ticks this session made do not count)."""
    me, deadline = conn.info.backend_pid, time.monotonic() + timeout
    wanted = {q.wake_payload(queue)} if wakes_only else {queue, q.wake_payload(queue)}
    while True:
        if any(n.pid != me and n.payload in wanted for n in conn.notifies(timeout=0)):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        # the wait itself on the socket: psycopg's notifies(timeout) polls in whole
        # milliseconds, and spun on polls of 0 ms through the last fraction of one (strace:
        # 8,400 polls in 3 s at 500 tps)
        select.select([conn.fileno()], [], [], left)
