"""The node row of a cascaded queue (Skytools' pgq_node): which node this database is, its
provider, where the set's nodes live, and the watermarks that hold history back.

A set is one queue shared by its nodes.  The root owns the queue and captures changes; a branch
replays its provider's batches and carries the queue; a leaf has no queue.  A subscriber reads
its provider's location from its own database (`node_location`), so changing provider needs
no config edit.  This module is the only one that reads or writes `pgcascade.node`,
`node_location` and `node_watermark`.

Role behaviour is decided once, in `NodeRole`, from the node type (the Skytools 3 table of
what each node type does); callers ask it instead of testing types.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from pgcascade.core import pgconn, schema
from pgcascade.core.errors import RuntimeFailure, UserError, db_error_line
from pgcascade.core.pgconn import scalar


class NodeType(enum.StrEnum):
    ROOT = "root"
    BRANCH = "branch"
    LEAF = "leaf"


@dataclass(frozen=True)
class NodeRole:
    """What a node of a given type does (seed 003, "Node behaviour")."""

    node_type: NodeType

    @property
    def is_root(self) -> bool:
        return self.node_type is NodeType.ROOT

    @property
    def has_queue(self) -> bool:
        return self.node_type in (NodeType.ROOT, NodeType.BRANCH)

    @property
    def reads_provider_queue(self) -> bool:
        return self.node_type in (NodeType.BRANCH, NodeType.LEAF)

    @property
    def copies_events(self) -> bool:
        return self.node_type is NodeType.BRANCH

    @property
    def captures_changes(self) -> bool:
        return self.node_type is NodeType.ROOT

    @property
    def may_merge_ticks(self) -> bool:
        """A leaf cuts no batches of its own, so it may apply several ticks at once."""
        return self.node_type is NodeType.LEAF


@dataclass
class Node:
    queue_name: str
    node_name: str
    node_type: NodeType
    provider_node: str | None
    worker_name: str | None
    last_tick: int | None
    paused: bool
    last_error: str | None
    combined_queue: str | None = None  # a merge-leaf: the combined queue it feeds
    peer_of: str | None = None  # a two-way peer subscription: the queue this master is the root of
    conflict_policy: str | None = None  # a peer subscription's default conflict policy
    apply_delay: timedelta | None = None  # a delayed leaf: the apply_delay its worker runs with
    all_tables: bool = False  # a subscriber that took the set's tables with add-table --all (and new ones)
    # a leaf between two ticks of its provider: the snapshot it applied up to, past last_tick
    # (sql/pgq/53_position.sql); None: at last_tick itself
    last_position: str | None = None

    def applied(self, tick: int, position: str | None = None) -> Node:
        """This node as a batch up to `tick` (and `position`) leaves its row (apply_begin,
        peer_batch_end)."""
        return dataclasses.replace(self, last_tick=tick, last_position=position, last_error=None)

    def last_tick_past(self, tick: float) -> bool:
        """Whether this node applied the tick (or one after it)."""
        return (self.last_tick or 0) >= tick

    @property
    def is_peer(self) -> bool:
        return self.peer_of is not None

    @property
    def role(self) -> NodeRole:
        return NodeRole(self.node_type)

    @property
    def consumer(self) -> str:
        """Its consumer name on the provider's queue."""
        return self.worker_name or self.node_name


NODE_COLUMNS = (
    "queue_name, node_name, node_type, provider_node, worker_name, last_tick, paused, last_error,"
    " combined_queue, peer_of, conflict_policy, apply_delay, all_tables, last_position"
)


# the node row's query: the worker sends it with a batch's statements (replica/inline.py)
NODE_QUERY = f"select {NODE_COLUMNS} from pgcascade.node where queue_name = %s"


def node_from(values: Sequence[Any]) -> Node:
    """A node from the values of NODE_COLUMNS."""
    queue, name, node_type, *rest = values
    return Node(queue, name, NodeType(node_type), *rest)


def node_rows(cursor: psycopg.Cursor) -> Callable[[Sequence[Any]], Node]:
    """The row factory of NODE_COLUMNS."""
    return node_from


def get_node(conn: psycopg.Connection, queue_name: str) -> Node | None:
    # one round trip where it can (the worker asks every round); the schema check first
    # inside a transaction, where a missing table would abort it
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE and conn.autocommit
    if not idle and schema.installed_version(conn) == 0:
        return None
    try:
        with conn.cursor(row_factory=node_rows) as cur:
            return cur.execute(
                f"select {NODE_COLUMNS} from pgcascade.node where queue_name = %s", (queue_name,)
            ).fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    except psycopg.errors.UndefinedColumn:
        raise UserError(
            "the pgcascade schema in this database is older than this release: run `pgcascade CONFIG install`"
        ) from None


def require_node(conn: psycopg.Connection, queue_name: str) -> Node:
    node = get_node(conn, queue_name)
    if node is None:
        raise UserError(
            f"this database is not a node of set {queue_name!r}: run create-root or create-leaf first"
        )
    return node


def locking_node(conn: psycopg.Connection, queue_name: str) -> psycopg.Cursor[Node]:
    """lock_node's query, its row left to fetch: in a pipeline, with other statements."""
    cur = conn.cursor(row_factory=node_rows)
    return cur.execute(
        f"select {NODE_COLUMNS} from pgcascade.node where queue_name = %s for update", (queue_name,)
    )


def lock_node(conn: psycopg.Connection, queue_name: str, share: bool = False) -> Node:
    """The node row, locked until the transaction ends: a batch in flight is waited for, and
    the next one is kept out.  `share`: the lanes of one parallel apply, which only need the
    row to stay as it is while they apply."""
    mode = "share" if share else "update"
    with conn.cursor(row_factory=node_rows) as cur:
        node = cur.execute(
            f"select {NODE_COLUMNS} from pgcascade.node where queue_name = %s for {mode}", (queue_name,)
        ).fetchone()
    if node is None:
        raise UserError(f"this database is not a node of set {queue_name!r}")
    return node


def insert_node(
    conn: psycopg.Connection,
    queue_name: str,
    node_name: str,
    node_type: NodeType,
    provider: str | None = None,
    last_tick: int | None = None,
    combined_queue: str | None = None,
    peer_of: str | None = None,
    conflict_policy: str | None = None,
) -> None:
    conn.execute(
        "insert into pgcascade.node (queue_name, node_name, node_type, provider_node, worker_name, last_tick,"
        " combined_queue, peer_of, conflict_policy) values (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            queue_name,
            node_name,
            node_type.value,
            provider,
            node_name if provider else None,
            last_tick,
            combined_queue,
            peer_of,
            conflict_policy,
        ),
    )


def peers(conn: psycopg.Connection, own_queue: str) -> list[Node]:
    """The peer subscriptions of the master that is the root of `own_queue` (two-way)."""
    with conn.cursor(row_factory=node_rows) as cur:
        return cur.execute(
            f"select {NODE_COLUMNS} from pgcascade.node where peer_of = %s order by provider_node",
            (own_queue,),
        ).fetchall()


def peer_ticks(conn: psycopg.Connection, own_queue: str) -> dict[str, int | None]:
    """How far the master that is the root of `own_queue` has applied each peer's queue."""
    return dict(
        conn.execute(
            "select queue_name, last_tick from pgcascade.node where peer_of = %s", (own_queue,)
        ).fetchall()
    )


def set_conflict_policy(conn: psycopg.Connection, queue_name: str, policy: str) -> None:
    conn.execute("update pgcascade.node set conflict_policy = %s where queue_name = %s", (policy, queue_name))


def take_all_tables(conn: psycopg.Connection, queue_name: str) -> None:
    """The subscriber took the set's tables with add-table --all: it takes those the root adds by
    DDL too (auto-ddl --add-new-tables)."""
    conn.execute("update pgcascade.node set all_tables = true where queue_name = %s", (queue_name,))


def applied_tick(conn: psycopg.Connection, queue_name: str) -> int:
    """The last tick this node applied (0 before the first)."""
    row = conn.execute("select last_tick from pgcascade.node where queue_name = %s", (queue_name,)).fetchone()
    return (row[0] if row else None) or 0


RECORD_APPLIED = (
    "update pgcascade.node set last_tick = %s, last_position = %s, last_error = null, last_error_time = null"
    " where queue_name = %s"
)


def record_applied(conn: psycopg.Connection, queue_name: str, tick: int, position: str | None = None) -> None:
    """The batch up to `tick` (and `position` past it) is applied: in the batch's own transaction
    (exactly once)."""
    conn.execute(RECORD_APPLIED, (tick, position, queue_name))


def record_error(conn: psycopg.Connection, queue_name: str, message: str | None) -> None:
    """Store (or clear, with None) the node's last error, in a transaction of its own."""
    conn.execute(
        "update pgcascade.node set last_error = %s, last_error_time = case when %s::text is null then null"
        " else now() end where queue_name = %s",
        (message, message, queue_name),
    )


def last_error(conn: psycopg.Connection, queue_name: str) -> tuple[str, Any] | None:
    """(message, time) of the node's last error, or None."""
    row = conn.execute(
        "select last_error, last_error_time from pgcascade.node where queue_name = %s", (queue_name,)
    ).fetchone()
    return (row[0], row[1]) if row and row[0] else None


def set_paused(conn: psycopg.Connection, queue_name: str, paused: bool) -> None:
    conn.execute("update pgcascade.node set paused = %s where queue_name = %s", (paused, queue_name))


def set_apply_delay(conn: psycopg.Connection, queue_name: str, delay: timedelta | None) -> None:
    """The delay this node's worker applies batches with (its config's apply_delay), for status."""
    conn.execute("update pgcascade.node set apply_delay = %s where queue_name = %s", (delay, queue_name))


def set_provider(conn: psycopg.Connection, queue_name: str, provider: str) -> None:
    conn.execute("update pgcascade.node set provider_node = %s where queue_name = %s", (provider, queue_name))


def become_root(conn: psycopg.Connection, queue_name: str) -> None:
    """The node row of a new root: no provider, resumed; it records the tick it took over from."""
    conn.execute(
        "update pgcascade.node set node_type = %s, provider_node = null, paused = false,"
        " root_since_tick = last_tick, last_error = null, last_error_time = null where queue_name = %s",
        (NodeType.ROOT.value, queue_name),
    )


def become_branch(conn: psycopg.Connection, queue_name: str, provider: str, tick: int) -> None:
    """The node row of an old root: a paused branch of `provider` from `tick`."""
    conn.execute(
        "update pgcascade.node set node_type = %s, provider_node = %s, last_tick = %s, paused = true,"
        " worker_name = coalesce(worker_name, node_name) where queue_name = %s",
        (NodeType.BRANCH.value, provider, tick, queue_name),
    )


def root_since_tick(conn: psycopg.Connection, queue_name: str) -> int | None:
    """The tick a root took over the set from (takeover), or None."""
    row = conn.execute(
        "select root_since_tick from pgcascade.node where queue_name = %s", (queue_name,)
    ).fetchone()
    return row[0] if row else None


def forget_set(conn: psycopg.Connection, queue_name: str) -> None:
    """This database stops being a node of the set: its node row, locations and watermarks go."""
    for table in ("node_location", "node_watermark", "node"):
        conn.execute(f"delete from pgcascade.{table} where queue_name = %s", (queue_name,))


# --- locations ----------------------------------------------------------------------------------


def locations(conn: psycopg.Connection, queue_name: str) -> dict[str, tuple[str, bool]]:
    """node name -> (location, dead) of every node this node knows."""
    return {
        name: (loc, dead)
        for name, loc, dead in conn.execute(
            "select node_name, node_location, dead from pgcascade.node_location where queue_name = %s order by 1",
            (queue_name,),
        )
    }


def node_location(conn: psycopg.Connection, queue_name: str, node_name: str) -> str:
    row = conn.execute(
        "select node_location from pgcascade.node_location where queue_name = %s and node_name = %s",
        (queue_name, node_name),
    ).fetchone()
    if row is None:
        raise RuntimeFailure(f"location of node {node_name!r} is unknown in set {queue_name!r}")
    return row[0]


def is_combined(conn: psycopg.Connection, queue_name: str) -> bool:
    """Whether merge-leaves in this database feed the queue (a combined queue)."""
    return scalar(
        conn, "select exists (select 1 from pgcascade.node where combined_queue = %s)", (queue_name,)
    )


def merged_partitions(conn: psycopg.Connection, node: Node) -> list[Node]:
    """A merge-leaf and the other merge-leaves in its database feeding the same combined queue."""
    return [node] + [
        n
        for (queue,) in conn.execute(
            "select queue_name from pgcascade.node where combined_queue = %s and queue_name <> %s order by 1",
            (node.combined_queue, node.queue_name),
        ).fetchall()
        if (n := get_node(conn, queue)) is not None
    ]


def provider_location(conn: psycopg.Connection, node: Node) -> str:
    if not node.provider_node:
        raise UserError(f"node {node.node_name} ({node.node_type}) has no provider")
    return node_location(conn, node.queue_name, node.provider_node)


def stored_location(node_name: str, location: str) -> str:
    """A node's location as pgcascade stores and sends it: without a password."""
    try:
        return pgconn.without_secrets(location)
    except psycopg.ProgrammingError as e:
        raise UserError(
            f"location of node {node_name} is not a connection string: {db_error_line(e)}"
        ) from None


def set_location(conn: psycopg.Connection, queue_name: str, node_name: str, location: str) -> None:
    """Store a node's location (its password left out: stored_location)."""
    location = stored_location(node_name, location)
    conn.execute(
        "insert into pgcascade.node_location (queue_name, node_name, node_location) values (%s, %s, %s)"
        " on conflict (queue_name, node_name) do update set node_location = excluded.node_location, dead = false",
        (queue_name, node_name, location),
    )


def mark_dead(conn: psycopg.Connection, queue_name: str, node_name: str) -> None:
    conn.execute(
        "update pgcascade.node_location set dead = true where queue_name = %s and node_name = %s",
        (queue_name, node_name),
    )


def delete_location(conn: psycopg.Connection, queue_name: str, node_name: str) -> None:
    conn.execute(
        "delete from pgcascade.node_location where queue_name = %s and node_name = %s",
        (queue_name, node_name),
    )


# --- watermarks ---------------------------------------------------------------------------------


def local_watermark(conn: psycopg.Connection, queue_name: str) -> int | None:
    """The lowest tick this node and the nodes below it still need."""
    row = conn.execute("select pgcascade.local_watermark(%s)", (queue_name,)).fetchone()
    return row[0] if row else None


def set_subscriber_watermark(conn: psycopg.Connection, queue_name: str, node_name: str, tick: int) -> None:
    """On a provider: node `node_name` (and the nodes below it) still needs ticks from `tick` on."""
    conn.execute("select pgcascade.set_subscriber_watermark(%s, %s, %s)", (queue_name, node_name, tick))


def watermarks(conn: psycopg.Connection, queue_name: str) -> list[tuple[str, int, Any]]:
    """(node, tick it needs, age of the report) of every subscriber that reports here."""
    return conn.execute(
        "select node_name, watermark, now() - reported from pgcascade.node_watermark where queue_name = %s"
        " order by watermark, node_name",
        (queue_name,),
    ).fetchall()


def forget_watermark(conn: psycopg.Connection, queue_name: str, node_name: str) -> None:
    conn.execute(
        "delete from pgcascade.node_watermark where queue_name = %s and node_name = %s",
        (queue_name, node_name),
    )


def global_watermark(conn: psycopg.Connection, queue_name: str) -> int | None:
    """The oldest tick this node keeps for the set (its '.global_watermark' registration)."""
    row = conn.execute(
        "select last_tick from pgcascade.get_consumer_info(%s, '.global_watermark')", (queue_name,)
    ).fetchone()
    return row[0] if row else None
