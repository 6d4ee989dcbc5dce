"""Moving subscribers between providers with no gap and no duplicate.

A subscriber moves at the tick it applied last: every node with a queue carries the same
batches with the same tick ids, so the new provider continues with the next one.
"""

from __future__ import annotations

import psycopg

from pgcascade.cascade.join import announce_at_root
from pgcascade.cascade.survey import connect, feeds_from, last_tick_of, member_location, reach, survey
from pgcascade.cascade.waits import Say, wait_for
from pgcascade.core.errors import RuntimeFailure, UserError
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import tables as subscriber


def change_provider(
    sub: psycopg.Connection,
    queue: str,
    new_provider: str,
    say: Say,
    timeout: float = 600,
    no_wait: bool = False,
) -> str:
    """Move this subscriber to another node with a queue, at the tick it applied last: the
    same batches follow there, so nothing is skipped or applied twice.  A new provider that
    is behind is waited for; one that no longer has the tick is refused."""
    node = nodes.require_node(sub, queue)
    if not node.role.reads_provider_queue:
        raise UserError(f"node {node.node_name} is the {node.node_type}: it has no provider")
    if new_provider == node.node_name:
        raise UserError("a node cannot be its own provider")
    if new_provider == node.provider_node:
        return f"{node.node_name} already feeds from {new_provider}"
    busy = subscriber.busy_tables(sub, queue)
    if busy:
        raise UserError(f"tables are being copied ({', '.join(busy)}): change provider when they are ok")
    loc = member_location(sub, queue, new_provider)
    if feeds_from(sub, queue, new_provider, node.node_name):
        raise UserError(f"{new_provider} feeds from {node.node_name}: that would make a loop")
    with connect(loc) as prov:
        pnode = nodes.get_node(prov, queue)
        if pnode is None or not pnode.role.has_queue:
            raise UserError(f"{new_provider} carries no queue (a leaf): it cannot be a provider")
        with sub.transaction():
            # the node row lock waits for a batch in flight and keeps the next one out
            locked = nodes.lock_node(sub, queue)
            if locked.last_position is not None:  # only its provider's snapshots say where it is
                raise RuntimeFailure(
                    f"{node.node_name} is between two ticks of {node.provider_node} (it reads between"
                    " ticks while it is the queue's only reader): its worker lands it on the next"
                    " tick now that another node reads the queue; try again in a moment"
                )
            tick = locked.last_tick or 0

            def reached() -> str | None:
                newest = last_tick_of(prov, queue) or 0
                return (
                    None
                    if newest >= tick
                    else f"{new_provider} is at tick {newest}, {node.node_name} at {tick}"
                )

            wait_for(f"{new_provider} to reach tick {tick}", reached, timeout, say, no_wait)
            if not q.has_tick(prov, queue, tick):
                raise RuntimeFailure(
                    f"{new_provider} no longer has tick {tick} (deleted behind its watermark):"
                    f" {node.node_name} cannot continue from it without a gap; resync its tables instead"
                )
            with prov.transaction():
                q.register_consumer_at(prov, queue, node.consumer, tick)
                nodes.set_location(
                    prov, queue, node.node_name, nodes.node_location(sub, queue, node.node_name)
                )
            nodes.set_provider(sub, queue, new_provider)
    old = node.provider_node
    old_loc = nodes.locations(sub, queue).get(old) if old else None
    if old_loc is not None:
        with reach(old_loc[0]) as oldc:
            if oldc is not None:
                forget_subscriber(oldc, queue, node.node_name, node.worker_name)
    return f"{node.node_name} feeds from {new_provider} at tick {tick} (was {old})"


def forget_subscriber(conn: psycopg.Connection, queue: str, name: str, consumer: str | None) -> None:
    """A provider stops keeping history for a subscriber that left it."""
    with conn.transaction():
        q.unregister_consumers(conn, queue, consumer or name, f"{consumer or name}.copy.")
        nodes.forget_watermark(conn, queue, name)


def release_everywhere(conn: psycopg.Connection, queue: str, name: str) -> None:
    """Every reachable node with a queue stops keeping history for node `name`."""
    for m in survey(conn, queue, skip=(name,)):
        if m.node is not None and m.node.role.has_queue:
            with reach(m.location) as c:
                if c is not None:
                    forget_subscriber(c, queue, name, name)


def take_subscribers(
    new: psycopg.Connection, queue: str, old_name: str, dead: bool, say: Say, timeout: float
) -> str:
    """This node takes over a branch's subscribers (the branch is dead, or just retiring)."""
    me = nodes.require_node(new, queue)
    if not me.role.has_queue:
        raise UserError(f"{me.node_name} is a leaf: it cannot feed other nodes")
    old_loc = member_location(new, queue, old_name)
    report = []
    for m in survey(new, queue, skip=(old_name,) if dead else ()):
        if m.node is None or m.node.provider_node != old_name or m.name == me.node_name:
            continue
        with connect(m.location) as mc:
            report.append(change_provider(mc, queue, me.node_name, say, timeout))
    if dead:
        release_everywhere(new, queue, old_name)
        if not announce_at_root(new, queue, old_name, old_loc, dead=True):
            report.append("the root is unreachable: mark the node dead again later (drop-node)")
    return "\n".join(report) or f"{old_name} fed no reachable node"
