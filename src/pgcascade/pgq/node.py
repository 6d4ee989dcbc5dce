"""Cascade membership: which node this database is, its provider, and where nodes live.

A set is one queue shared by its nodes.  The root owns the queue and captures changes; a leaf
has no queue and replays its provider's batches.  A subscriber reads its provider's location
from its own database (`node_location`), so changing provider needs no config edit.

Role behaviour is decided once, in `NodeRole`, from the node type (the Skytools 3 table of
what each node type does); the worker asks it instead of testing types everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.rows import class_row

from pgcascade.core import pgconn, schema
from pgcascade.core.errors import RuntimeFailure, UserError
from pgcascade.pgq import queue as q


@dataclass(frozen=True)
class NodeRole:
    """What a node of a given type does (seed 003, "Node behaviour")."""

    node_type: str

    @property
    def has_queue(self) -> bool:
        return self.node_type in ("root", "branch")

    @property
    def reads_provider_queue(self) -> bool:
        return self.node_type in ("branch", "leaf")

    @property
    def copies_events(self) -> bool:
        return self.node_type == "branch"

    @property
    def captures_changes(self) -> bool:
        return self.node_type == "root"

    @property
    def may_merge_ticks(self) -> bool:
        """A leaf cuts no batches of its own, so it may apply several ticks at once."""
        return self.node_type == "leaf"


@dataclass
class Node:
    queue_name: str
    node_name: str
    node_type: str
    provider_node: str | None
    worker_name: str | None
    last_tick: int | None
    paused: bool
    last_error: str | None
    combined_queue: str | None = None  # a merge-leaf: the combined queue it feeds

    @property
    def role(self) -> NodeRole:
        return NodeRole(self.node_type)


def get_node(conn: psycopg.Connection, queue_name: str) -> Node | None:
    # one round trip where it can (the worker asks every round); the schema check first
    # inside a transaction, where a missing table would abort it
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE and conn.autocommit
    if not idle and schema.installed_version(conn) == 0:
        return None
    try:
        return _select_node(conn, queue_name)
    except psycopg.errors.UndefinedTable:
        return None
    except psycopg.errors.UndefinedColumn:
        raise UserError(
            "the pgcascade schema in this database is older than this release: run `pgcascade CONFIG install`"
        ) from None


def _select_node(conn: psycopg.Connection, queue_name: str) -> Node | None:
    with conn.cursor(row_factory=class_row(Node)) as cur:
        return cur.execute(
            "select queue_name, node_name, node_type, provider_node, worker_name, last_tick, paused, last_error,"
            " combined_queue from pgcascade.node where queue_name = %s",
            (queue_name,),
        ).fetchone()


def require_node(conn: psycopg.Connection, queue_name: str) -> Node:
    node = get_node(conn, queue_name)
    if node is None:
        raise UserError(
            f"this database is not a node of set {queue_name!r}: run create-root or create-leaf first"
        )
    return node


def node_location(conn: psycopg.Connection, queue_name: str, node_name: str) -> str:
    row = conn.execute(
        "select node_location from pgcascade.node_location where queue_name = %s and node_name = %s",
        (queue_name, node_name),
    ).fetchone()
    if row is None:
        raise RuntimeFailure(f"location of node {node_name!r} is unknown in set {queue_name!r}")
    return row[0]


def provider_location(conn: psycopg.Connection, node: Node) -> str:
    if not node.provider_node:
        raise UserError(f"node {node.node_name} ({node.node_type}) has no provider")
    return node_location(conn, node.queue_name, node.provider_node)


def set_location(conn: psycopg.Connection, queue_name: str, node_name: str, location: str) -> None:
    conn.execute(
        "insert into pgcascade.node_location (queue_name, node_name, node_location) values (%s, %s, %s)"
        " on conflict (queue_name, node_name) do update set node_location = excluded.node_location, dead = false",
        (queue_name, node_name, location),
    )


def already_node(conn: psycopg.Connection, queue_name: str, node_name: str, node_type: str) -> bool:
    """True if this database is that node already (creating it again is a no-op); an error if
    it is another node of the set."""
    existing = get_node(conn, queue_name)
    if existing is None:
        return False
    if existing.node_name == node_name and existing.node_type == node_type:
        return True
    raise UserError(
        f"this database is already node {existing.node_name} ({existing.node_type}) of {queue_name}"
    )


def create_root(conn: psycopg.Connection, queue_name: str, node_name: str, location: str) -> bool:
    """Install the schema, create the set's queue and register this database as its root."""
    schema.install(conn)
    if already_node(conn, queue_name, node_name, "root"):
        return False
    with conn.transaction():
        q.create_queue(conn, queue_name)
        conn.execute(
            "insert into pgcascade.node (queue_name, node_name, node_type) values (%s, %s, 'root')",
            (queue_name, node_name),
        )
        set_location(conn, queue_name, node_name, location)
    return True


def create_subscriber(
    conn: psycopg.Connection,
    queue_name: str,
    node_name: str,
    node_type: str,
    location: str,
    provider_connstr: str,
    merge: str | None = None,
) -> bool:
    """Install the schema here and make this database a leaf or a branch of the set: register
    it as a consumer on the provider's queue and record the provider's view of the set's
    locations.  A branch gets a queue of its own that starts at the tick it registered at,
    and a copy of the set's table list (its own subscribers choose from it).  A leaf given
    `merge` (a combined queue of this database) is a merge-leaf."""
    schema.install(conn)
    if already_node(conn, queue_name, node_name, node_type):
        return False
    if merge is not None:
        combined = get_node(conn, merge)
        if node_type != "leaf" or combined is None or not combined.role.has_queue:
            raise UserError(
                f"--merge={merge}: a merge-leaf needs the combined set's root or branch in this database first"
            )
    with pgconn.connect(provider_connstr, autocommit=True, connect_timeout=10) as prov:
        pnode = get_node(prov, queue_name)
        if pnode is None or not pnode.role.has_queue:
            raise UserError(f"the provider is not a root or branch of set {queue_name!r}")
        if pnode.node_name == node_name:
            raise UserError(f"node name {node_name!r} is the provider's own name")
        with prov.transaction():
            q.register_consumer(prov, queue_name, node_name)
            tick, tick_time, event_seq = prov.execute(
                "select tick_id, tick_time, tick_event_seq from pgcascade.consumer_tick(%s, %s)",
                (queue_name, node_name),
            ).fetchone()
            set_location(prov, queue_name, node_name, location)
        locations = prov.execute(
            "select node_name, node_location from pgcascade.node_location where queue_name = %s",
            (queue_name,),
        ).fetchall()
        set_tables = prov.execute(
            "select table_name, key_columns, event_format from pgcascade.set_table where queue_name = %s",
            (queue_name,),
        ).fetchall()
    with conn.transaction():
        if node_type == "branch":
            conn.execute(
                "select pgcascade.create_branch_queue(%s, %s, %s, %s)",
                (queue_name, tick, tick_time, event_seq),
            )
            mirror_set_tables(conn, queue_name, set_tables)
        conn.execute(
            "insert into pgcascade.node (queue_name, node_name, node_type, provider_node, worker_name, last_tick,"
            " combined_queue) values (%s, %s, %s, %s, %s, %s, %s)",
            (queue_name, node_name, node_type, pnode.node_name, node_name, tick, merge),
        )
        for name, loc in locations:
            set_location(conn, queue_name, name, loc)
        set_location(conn, queue_name, pnode.node_name, provider_connstr)
        set_location(conn, queue_name, node_name, location)
    return True


def mirror_set_tables(conn: psycopg.Connection, queue_name: str, rows: list[tuple]) -> None:
    """A branch keeps the set's table list as its provider has it: its subscribers choose from
    it, and it captures these tables if it becomes the root."""
    conn.execute("delete from pgcascade.set_table where queue_name = %s", (queue_name,))
    for table, keys, fmt in rows:
        conn.execute(
            "insert into pgcascade.set_table (queue_name, table_name, key_columns, event_format)"
            " values (%s, %s, %s, %s)",
            (queue_name, table, keys, fmt),
        )


def record_error(conn: psycopg.Connection, queue_name: str, message: str | None) -> None:
    """Store (or clear, with None) the node's last error, in a transaction of its own."""
    conn.execute(
        "update pgcascade.node set last_error = %s, last_error_time = case when %s::text is null then null"
        " else now() end where queue_name = %s",
        (message, message, queue_name),
    )
