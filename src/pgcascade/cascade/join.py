"""Nodes join the set: create-root, create-branch, create-leaf, and the locations every node
learns from the root (`pgcascade.location` events).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import datetime

import psycopg

from pgcascade.capture import logical as walcapture
from pgcascade.capture import tables as set_tables
from pgcascade.cascade.survey import connect, find_root
from pgcascade.core import pgconn, privileges, schema
from pgcascade.core.errors import RuntimeFailure, UserError
from pgcascade.core.hooks import pause_point
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.node import NodeType

log = logging.getLogger("pgcascade")


def already_node(conn: psycopg.Connection, queue: str, node_name: str, node_type: NodeType) -> bool:
    """True if this database is that node already (creating it again is a no-op); an error if
    it is another node of the set."""
    existing = nodes.get_node(conn, queue)
    if existing is None:
        return False
    if existing.node_name == node_name and existing.node_type is node_type:
        return True
    raise UserError(f"this database is already node {existing.node_name} ({existing.node_type}) of {queue}")


def check_rights(conn: psycopg.Connection, node_type: NodeType, logical: bool = False) -> None:
    """Refuse up front, naming the grant to run, what this role could not do as such a node
    (core/privileges.py): every node installs the schema; a subscriber applies with
    session_replication_role = replica; logical capture reads a slot."""
    privileges.require(
        conn,
        privileges.schema(conn),
        privileges.replica_role(conn) if node_type is not NodeType.ROOT else None,
        privileges.replication(conn) if logical else None,
    )


def create_root(
    conn: psycopg.Connection, queue: str, node_name: str, location: str, logical: bool = False
) -> bool:
    """Install the schema, create the set's queue and register this database as its root, all
    or nothing.  With `logical`, the publication and the slot come first (a slot cannot be made
    in a transaction that has written) and are dropped again if the rest fails; a trigger root
    drops a slot a failed logical attempt left behind."""
    check_rights(conn, NodeType.ROOT, logical)
    schema.install(conn)
    if already_node(conn, queue, node_name, NodeType.ROOT):
        return False
    setup = walcapture.prepare_slot(conn, queue) if logical else None
    if setup is None:
        walcapture.drop_leftovers(conn, queue)
    try:
        with conn.transaction():
            q.create_queue(conn, queue)
            nodes.insert_node(conn, queue, node_name, NodeType.ROOT)
            nodes.set_location(conn, queue, node_name, location)
            if setup is not None:
                walcapture.register(conn, queue, setup)
    except BaseException:
        if setup is not None:
            walcapture.undo(conn, setup)
        raise
    return True


def create_subscriber(
    conn: psycopg.Connection,
    queue: str,
    node_name: str,
    node_type: NodeType,
    location: str,
    provider_connstr: str,
    merge: str | None = None,
) -> bool:
    """Install the schema here and make this database a leaf or a branch of the set: register
    it as a consumer on the provider's queue and record the provider's view of the set's
    locations.  A branch gets a queue of its own that starts at the tick it registered at,
    and a copy of the set's table list (its own subscribers choose from it).  A leaf given
    `merge` (a combined queue of this database) is a merge-leaf."""
    check_rights(conn, node_type)
    schema.install(conn)
    if already_node(conn, queue, node_name, node_type):
        ensure_registered(conn, nodes.require_node(conn, queue))
        return False
    if merge is not None:
        combined = nodes.get_node(conn, merge)
        if node_type is not NodeType.LEAF or combined is None or not combined.role.has_queue:
            raise UserError(
                f"--merge={merge}: a merge-leaf needs the combined set's root or branch in this database first"
            )
    with pgconn.connect(provider_connstr, autocommit=True, connect_timeout=10) as prov:
        privileges.require(prov, privileges.schema(prov, installs=False), where="on the provider")
        pnode = nodes.get_node(prov, queue)
        if pnode is None or not pnode.role.has_queue:
            raise UserError(f"the provider is not a root or branch of set {queue!r}")
        if pnode.node_name == node_name:
            raise UserError(f"node name {node_name!r} is the provider's own name")
        locations = nodes.locations(prov, queue)
        rows = set_tables.set_table_rows(prov, queue)
        with registered_on(prov, queue, node_name, location) as position, conn.transaction():
            tick, tick_time, event_seq = position
            if node_type is NodeType.BRANCH:
                q.create_branch_queue(conn, queue, tick, tick_time, event_seq)
                set_tables.mirror_set_tables(conn, queue, rows)
            nodes.insert_node(conn, queue, node_name, node_type, pnode.node_name, tick, merge)
            for name, (loc, _dead) in locations.items():
                nodes.set_location(conn, queue, name, loc)
            nodes.set_location(conn, queue, pnode.node_name, provider_connstr)
            nodes.set_location(conn, queue, node_name, location)
    return True


@contextlib.contextmanager
def registered_on(
    prov: psycopg.Connection, queue: str, consumer: str, location: str
) -> Iterator[tuple[int, datetime, int]]:
    """Register `consumer` on the provider's queue (and its location there) in a provider
    transaction that commits only after the caller's block - this node's own record - has
    committed: a failure anywhere before leaves the provider as it was (no consumer holding its
    history for ever).  A crash between the two commits leaves a node that is not registered;
    the same create command again registers it (ensure_registered)."""
    with prov.transaction():
        q.register_consumer(prov, queue, consumer)
        position = q.consumer_tick(prov, queue, consumer)
        assert position is not None
        nodes.set_location(prov, queue, consumer, location)
        yield position
        pause_point("recorded-not-registered")


def ensure_registered(conn: psycopg.Connection, node: nodes.Node) -> bool:
    """A subscriber whose creation died between its own commit and its provider's: registered
    on the provider again, at the tick it is at; True if it had to be."""
    if node.provider_node is None:
        return False
    try:
        prov = pgconn.connect(nodes.provider_location(conn, node), autocommit=True, connect_timeout=10)
    except psycopg.OperationalError:
        return False  # the worker says so; a later create-leaf tries again
    with prov:
        if (q.consumer_tick(prov, node.queue_name, node.consumer) or (None,))[0] is not None:
            return False
        own = nodes.node_location(conn, node.queue_name, node.node_name)
        try:
            with prov.transaction():
                q.register_consumer_at(prov, node.queue_name, node.consumer, node.last_tick or 0)
                nodes.set_location(prov, node.queue_name, node.node_name, own)
        except psycopg.errors.NoDataFound:
            raise RuntimeFailure(
                f"{node.node_name} is not registered on its provider {node.provider_node}, which no longer has"
                f" tick {node.last_tick}: drop this node (drop-node) and create it again"
            ) from None
    log.info(
        "%s registered again on its provider %s at tick %s",
        node.node_name,
        node.provider_node,
        node.last_tick,
    )
    return True


def announce_location(
    root: psycopg.Connection, queue: str, name: str, location: str | None, dead: bool = False
) -> None:
    """On the root: store a node's location (None: the node left) and send it down the set
    (without a password, as every location)."""
    if location is not None:
        location = nodes.stored_location(name, location)
    with root.transaction():
        if location is None:
            nodes.delete_location(root, queue, name)
        else:
            nodes.set_location(root, queue, name, location)
            if dead:
                nodes.mark_dead(root, queue, name)
        q.insert_event(root, queue, "pgcascade.location", name, location, "dead" if dead else None)


def announce_at_root(
    conn: psycopg.Connection, queue: str, name: str, location: str | None, dead: bool = False
) -> bool:
    """announce_location on the root, wherever it is; False when the root cannot be reached."""
    try:
        _, root_loc = find_root(conn, queue)
        with connect(root_loc) as root:
            announce_location(root, queue, name, location, dead)
        return True
    except (psycopg.OperationalError, RuntimeFailure):
        return False
