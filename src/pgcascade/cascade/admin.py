"""Set administration: dropping a node, pausing one, an old root coming back (resurrect),
and merge-leaf table lists.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import psycopg

from pgcascade.capture import tables as set_tables
from pgcascade.cascade.join import announce_at_root, announce_location, create_subscriber
from pgcascade.cascade.provider import release_everywhere
from pgcascade.cascade.survey import connect, member_location, reach, survey
from pgcascade.cascade.takeover import refuse_logical_capture
from pgcascade.cascade.waits import Say
from pgcascade.core import catalog
from pgcascade.core.errors import RuntimeFailure, UserError
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.node import NodeType
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber

LOST_EVENT_FIELDS = (
    "ev_id",
    "ev_time",
    "ev_txid",
    "ev_type",
    "ev_data",
    "ev_extra1",
    "ev_extra2",
    "ev_extra3",
    "ev_extra4",
)


def drop_node(conn: psycopg.Connection, queue: str, name: str) -> str:
    """Remove a node from the set: its registrations and watermark go (rotation is released
    at once), every node forgets its location, and the node itself - when it answers - stops
    being a node (its tables and rows stay)."""
    loc = member_location(conn, queue, name)
    members = survey(conn, queue)
    fed = [m.name for m in members if m.node is not None and m.node.provider_node == name]
    if fed:
        raise UserError(f"{name} still feeds {', '.join(fed)}: move them first (change-provider)")
    target = next((m for m in members if m.name == name), None)
    if target is not None and target.node is not None and target.node.role.is_root and len(members) > 1:
        raise UserError(f"{name} is the root: take it over first (takeover), then drop it")
    release_everywhere(conn, queue, name)
    with reach(loc) as c:
        if c is not None and nodes.get_node(c, queue) is not None:
            leave_set(c, queue)
    if not announce_at_root(conn, queue, name, None):
        nodes.delete_location(conn, queue, name)
        return f"dropped {name} (the root is unreachable: other nodes still list its location)"
    return f"dropped {name}"


def leave_set(conn: psycopg.Connection, queue: str) -> None:
    """This database stops being a node of the set; its tables and their rows stay, writable."""
    with conn.transaction():
        subscriber.release_all(conn, queue)
        set_tables.release_all(conn, queue)
        nodes.forget_set(conn, queue)
        if q.exists(conn, queue):
            q.drop_queue(conn, queue, force=True)


def set_paused(conn: psycopg.Connection, queue: str, name: str, paused: bool) -> str:
    """Pause or resume a node's worker, through the node's own database."""
    me = nodes.require_node(conn, queue)
    loc = None if name == me.node_name else member_location(conn, queue, name)
    with contextlib.ExitStack() as stack:
        target = conn if loc is None else stack.enter_context(connect(loc))
        n = nodes.require_node(target, queue)
        nodes.set_paused(target, queue, paused)
        if not paused and n.provider_node:
            wake_worker(target, n)
    return f"{n.node_name}: {'paused' if paused else 'resumed'}"


def wake_worker(conn: psycopg.Connection, node: nodes.Node) -> None:
    """A resumed worker waits on its provider's tick channel: wake it there now, not at its
    next tick or loop_delay (an unreachable provider only leaves it to those)."""
    with (
        contextlib.suppress(psycopg.Error, RuntimeFailure),
        connect(nodes.provider_location(conn, node)) as prov,
    ):
        q.wake_consumers(prov, node.queue_name)


# --- an old root comes back ------------------------------------------------------------------------


def resurrect(conn: psycopg.Connection, queue: str, location: str, lost_file: Path, say: Say) -> str:
    """This database was the root, was taken over while it was lost, and answers again: write
    the events it has that never reached the set (after the tick the new root took over from) to
    `lost_file`, one JSON object per line, then make it a branch of the new root whose tables are
    copied again (its own rows may hold those lost changes)."""
    me = nodes.require_node(conn, queue)
    if not me.role.is_root:
        raise UserError(f"{me.node_name} is the {me.node_type}: only an old root is resurrected")
    refuse_logical_capture(conn, queue, me.node_name, "resurrect")
    roots = [m for m in survey(conn, queue, skip=(me.node_name,)) if m.node and m.node.role.is_root]
    if not roots:
        raise UserError(f"no other node of {queue} is the root: {me.node_name} still is")
    new_root = roots[0]
    with connect(new_root.location) as rc:
        since = nodes.root_since_tick(rc, queue)
    if since is None:
        raise RuntimeFailure(f"{new_root.name} does not record where it took over: cannot tell what was lost")
    lost = write_lost_events(conn, queue, since, lost_file)
    tables = list(set_tables.set_tables(conn, queue))
    seqs = set_tables.set_seqs(conn, queue)
    leave_set(conn, queue)
    create_subscriber(conn, queue, me.node_name, NodeType.BRANCH, location, new_root.location)
    with connect(new_root.location) as rc:
        announce_location(rc, queue, me.node_name, location)
        in_set = set_tables.set_tables(rc, queue)
    with conn.transaction():
        again = {t: in_set[t] for t in tables if t in in_set and catalog.table_exists(conn, t)}
        subscriber.adopt(conn, queue, again, states.NEW)
        subscriber_seqs.follow_seqs(conn, queue, seqs)
        set_tables.follow_seqs(conn, queue, seqs)  # as a branch, it passes them on
    say(f"{lost} events that never reached the set written to {lost_file}")
    return f"{me.node_name} is a branch of {new_root.name}; its tables are copied again from there"


def write_lost_events(conn: psycopg.Connection, queue: str, since: int, path: Path) -> int:
    """Every event of this queue after tick `since` (a last tick first takes in those not ticked
    yet), streamed to `path` as JSON lines, in event order."""
    q.ticker(conn, queue)
    probe = ".resurrect"
    if not q.has_tick(conn, queue, since):
        raise RuntimeFailure(
            f"tick {since} is no longer in this node's queue: the lost events cannot be read"
        )
    q.register_consumer_at(conn, queue, probe, since)
    n = 0
    with path.open("w") as out:
        while True:
            info = q.next_batch_info(conn, queue, probe)
            if info.batch_id is None:
                break
            with conn.transaction(), conn.cursor(name="lost") as cur:
                cur.execute(
                    "select ev_id, ev_time::text, ev_txid, ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3,"
                    " ev_extra4 from pgcascade.get_batch_events(%s) order by ev_id",
                    (info.batch_id,),
                )
                for row in cur:
                    out.write(json.dumps(dict(zip(LOST_EVENT_FIELDS, row, strict=True))) + "\n")
                    n += 1
            q.finish_batch(conn, info.batch_id)
    q.unregister_consumer(conn, queue, probe)
    return n


# --- combined partitions ------------------------------------------------------------------------------


def register_merged_tables(conn: psycopg.Connection, combined: str, part: str, tables: list[str]) -> None:
    """Tables a merge-leaf applies become tables of the combined set (on its root: on a
    combined-failover branch the list comes from the root), announced with a table-list event."""
    cnode = nodes.get_node(conn, combined)
    if cnode is None or not cnode.role.is_root:
        return
    held = {t.table_name: t.key_columns for t in subscriber.tables(conn, part) if t.table_name in tables}
    with conn.transaction():
        set_tables.add_to_set(conn, combined, held)
