"""What this node knows of the set: its members, read from their own databases.

Each command runs where the user runs it and reaches the other nodes through the locations
this node stores (they travel as `pgcascade.location` events from the root).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import psycopg

from pgcascade.core import pgconn
from pgcascade.core.errors import RuntimeFailure, UserError, db_error_line
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q

NOT_A_NODE = "not a node of the set"  # a Member that answers but is no pgcascade node of it


def connect(location: str, timeout: int = 5) -> psycopg.Connection:
    return pgconn.connect(location, autocommit=True, connect_timeout=timeout)


@contextlib.contextmanager
def reach(location: str) -> Iterator[psycopg.Connection | None]:
    """A connection to another node, or None when it cannot be reached."""
    try:
        conn = connect(location)
    except psycopg.OperationalError:
        yield None
        return
    with conn:
        yield conn


@dataclass
class Member:
    name: str
    location: str
    dead: bool
    node: nodes.Node | None = None  # read from the node itself; None when unreachable
    error: str | None = None


def survey(conn: psycopg.Connection, queue: str, skip: tuple[str, ...] = ()) -> list[Member]:
    """Every known node, each read from its own database when reachable."""
    out = []
    for name, (loc, dead) in nodes.locations(conn, queue).items():
        m = Member(name, loc, dead)
        if name not in skip:
            try:
                with connect(loc, timeout=3) as c:
                    m.node = nodes.get_node(c, queue)
                    if m.node is None or m.node.node_name != name:
                        m.node, m.error = None, NOT_A_NODE
            except psycopg.Error as e:
                m.error = db_error_line(e)
        out.append(m)
    return out


def member_location(conn: psycopg.Connection, queue: str, name: str) -> str:
    """The location of a member of the set, or a one-line error naming the command that lists them."""
    loc = nodes.locations(conn, queue).get(name)
    if loc is None:
        raise UserError(f"node {name!r} is not a member of set {queue!r} (see members)")
    return loc[0]


def find_root(conn: psycopg.Connection, queue: str) -> tuple[str, str]:
    """(name, location) of the set's root, found by following providers upward."""
    node = nodes.require_node(conn, queue)
    seen = set()
    current, here = node, conn
    opened: list[psycopg.Connection] = []
    try:
        while not current.role.is_root:
            if current.node_name in seen or not current.provider_node:
                raise RuntimeFailure(f"no root above node {node.node_name}")
            seen.add(current.node_name)
            here = connect(nodes.node_location(here, queue, current.provider_node))
            opened.append(here)
            nxt = nodes.get_node(here, queue)
            if nxt is None:
                raise RuntimeFailure(f"provider {current.provider_node} is not a node of {queue}")
            current = nxt
        return current.node_name, nodes.node_location(conn, queue, current.node_name)
    finally:
        for c in opened:
            c.close()


def last_tick_of(conn: psycopg.Connection, queue: str) -> int | None:
    """The newest tick of this node's queue, or (a leaf) the last tick it applied."""
    node = nodes.require_node(conn, queue)
    if node.role.has_queue:
        return q.last_tick_id(conn, queue)
    return node.last_tick


def reporters(location: str, queue: str) -> set[str]:
    """The nodes that report their watermark to the node at `location`: its subscribers."""
    with reach(location) as c:
        if c is None:
            return set()
        return {name for name, _, _ in nodes.watermarks(c, queue)}


def feeds_from(conn: psycopg.Connection, queue: str, name: str, ancestor: str) -> bool:
    """Whether node `name` (read through `conn`'s locations) is `ancestor` or below it."""
    known = nodes.locations(conn, queue)
    seen = set()
    current: str | None = name
    while current and current not in seen:
        if current == ancestor:
            return True
        seen.add(current)
        loc = known.get(current)
        if loc is None:
            return False
        with reach(loc[0]) as c:
            n = nodes.get_node(c, queue) if c is not None else None
        current = n.provider_node if n is not None else None
    return False


@dataclass
class Position:
    tick: int  # the last tick the node applied (the root: its newest)
    behind: int  # ticks behind the root
    lag: timedelta | None  # age of that tick on the root


def tree_rows(conn: psycopg.Connection, queue: str) -> tuple[list[Member], dict[str, Position]]:
    """Every member, and for the reachable ones: lag behind the root in ticks and time."""
    members = survey(conn, queue)
    root = next((m for m in members if m.node is not None and m.node.role.is_root), None)
    info: dict[str, Position] = {}
    if root is None:
        return members, info
    with reach(root.location) as rc:
        if rc is None:
            return members, info
        newest = last_tick_of(rc, queue) or 0
        for m in members:
            if m.node is None:
                continue
            tick = newest if m.node.role.is_root else (m.node.last_tick or 0)
            info[m.name] = Position(tick, max(newest - tick, 0), q.tick_age(rc, queue, tick))
    return members, info
