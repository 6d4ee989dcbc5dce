"""Waiting on purpose (seed 004: a command waits for the work it depends on): for a node to
apply a tick, for the root's changes to arrive, for tables to reach a provider.  Each wait says
what is outstanding every REPORT_EVERY seconds and gives up with a one-line error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import psycopg

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade.survey import connect, find_root, last_tick_of
from pgcascade.core import catalog
from pgcascade.core.errors import RuntimeFailure, UserError, db_error_line
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import tables as subscriber

REPORT_EVERY = 10.0  # seconds between "still waiting for ..." lines (seed 004's slonik habit)

Say = Callable[[str], None]


def wait_for(
    what: str,
    done: Callable[[], str | None],
    timeout: float,
    say: Say,
    no_wait: bool = False,
    poll: float = 0.05,
) -> None:
    """Poll `done()` (None when done, else what is outstanding) until it is done; say what is
    outstanding every REPORT_EVERY seconds; a RuntimeFailure after `timeout` (at once with
    no_wait)."""
    deadline = time.monotonic() + timeout
    next_report = time.monotonic() + REPORT_EVERY
    while True:
        outstanding = done()
        if outstanding is None:
            return
        if no_wait or time.monotonic() > deadline:
            raise RuntimeFailure(
                f"{what}: {outstanding}" + ("" if no_wait else f" (gave up after {timeout:.0f}s)")
            )
        if time.monotonic() >= next_report:
            say(f"waiting for {what}: {outstanding}")
            next_report += REPORT_EVERY
        time.sleep(poll)


def wait_applied(
    conn: psycopg.Connection, queue: str, tick: int, what: str, say: Say, timeout: float
) -> None:
    """Until this node applied tick `tick`."""

    def outstanding() -> str | None:
        applied = nodes.applied_tick(conn, queue)
        return None if applied >= tick else f"at tick {applied}"

    wait_for(f"{what} (tick {tick})", outstanding, timeout, say)


def wait_root(conn: psycopg.Connection, queue: str, say: Say, timeout: float) -> int:
    """Wait until this node applied everything committed on the root before now."""
    me = nodes.require_node(conn, queue)
    if me.role.is_root:
        return last_tick_of(conn, queue) or 0
    _, loc = find_root(conn, queue)
    with connect(loc) as root:
        tick = q.ticker(root, queue)
    wait_applied(conn, queue, tick, "the root's changes to arrive here", say, timeout)
    return tick


def wait_provider(conn: psycopg.Connection, queue: str, say: Say, timeout: float) -> int:
    """Wait until this node applied every tick its provider has now."""
    me = nodes.require_node(conn, queue)
    with connect(nodes.provider_location(conn, me)) as prov:
        tick = last_tick_of(prov, queue) or 0
    wait_applied(conn, queue, tick, f"{me.provider_node}'s ticks to be applied here", say, timeout)
    return tick


def wait_sync(conn: psycopg.Connection, prov: psycopg.Connection, node: nodes.Node, timeout: float) -> None:
    """Wait until every table is ok and the node applied a tick taken after this call began
    (a delayed leaf applies it one apply_delay later: a timeout not above that is refused)."""
    delay = node.apply_delay.total_seconds() if node.apply_delay else 0.0
    if delay and timeout <= delay:
        raise UserError(
            f"{node.node_name} applies changes {delay:g} s late (apply_delay): wait-sync waits at least"
            " that long; give a --timeout above it"
        )
    queue = node.queue_name
    prov_node = nodes.get_node(prov, queue)
    if prov_node is not None and prov_node.role.is_root:
        if logical.is_logical(prov, queue):
            logical.wait_captured(prov, queue, timeout)  # the slot read up to now
        target = q.ticker(prov, queue)  # a tick now: everything committed so far is in it
    else:
        target = q.last_tick_id(prov, queue) or 0

    def outstanding() -> str | None:
        pending = [t.table_name for t in subscriber.tables(conn, queue) if not t.state.is_ok]
        last = nodes.applied_tick(conn, queue)
        if not pending and last >= target:
            return None
        return f"at tick {last} of {target}" + (f"; tables not ok: {', '.join(pending)}" if pending else "")

    wait_for("not in sync", outstanding, timeout, lambda _line: None, poll=0.1)


def wait_sync_peers(conn: psycopg.Connection, node: nodes.Node, timeout: float) -> None:
    """A two-way master: wait until it applied every peer's changes committed before this call -
    a tick made now on each peer's queue (after its logical capture read the WAL up to now),
    applied here by the worker, with every table ok under that peer.  A root without peers has
    every change already."""
    peers = nodes.peers(conn, node.queue_name)
    deadline = time.monotonic() + timeout
    targets: dict[str, tuple[str, int]] = {}
    for p in peers:
        assert p.provider_node is not None
        try:
            with connect(nodes.provider_location(conn, p), timeout=10) as prov:
                if logical.is_logical(prov, p.queue_name):
                    logical.wait_captured(prov, p.queue_name, max(deadline - time.monotonic(), 0.0))
                targets[p.queue_name] = (p.provider_node, q.ticker(prov, p.queue_name))
        except psycopg.OperationalError as e:
            raise RuntimeFailure(
                f"master {p.provider_node} does not answer ({db_error_line(e)}): its changes cannot be waited for"
            ) from None

    def outstanding() -> str | None:
        lacking = []
        for queue, (peer, tick) in targets.items():
            applied = nodes.applied_tick(conn, queue)
            pending = [t.table_name for t in subscriber.tables(conn, queue) if not t.state.is_ok]
            if applied < tick or pending:
                lacking.append(
                    f"from {peer} at tick {applied} of {tick}"
                    + (f", tables not ok: {', '.join(pending)}" if pending else "")
                )
        return "; ".join(lacking) or None

    wait_for("not in sync", outstanding, max(deadline - time.monotonic(), 0.0), lambda _line: None, poll=0.1)


def wait_provider_has_tables(
    conn: psycopg.Connection, prov: psycopg.Connection, queue: str, names: list[str], say: Say, timeout: float
) -> None:
    """Tables just added on the root reach a branch's table list with the queue: wait for them
    there, if the root has them."""
    _wait_provider_lists(conn, prov, queue, names, say, timeout, "tables", set_tables.set_tables)


def wait_provider_has_seqs(
    conn: psycopg.Connection, prov: psycopg.Connection, queue: str, names: list[str], say: Say, timeout: float
) -> None:
    """Sequences the root has: wait until the provider passes them on (a branch lists those it
    follows itself, once add-seq has run there; Londiste 3 users run the commands node after
    node without waiting in between)."""
    _wait_provider_lists(conn, prov, queue, names, say, timeout, "sequences", set_tables.set_seqs)


def _wait_provider_lists(
    conn: psycopg.Connection,
    prov: psycopg.Connection,
    queue: str,
    names: list[str],
    say: Say,
    timeout: float,
    kind: str,
    listed: Callable[[psycopg.Connection, str], Collection[str]],
) -> None:
    wanted = [catalog.canonical(prov, n) for n in names]
    if all(t in listed(prov, queue) for t in wanted):
        return
    try:
        _, loc = find_root(conn, queue)
        with connect(loc) as root:
            at_root = set(listed(root, queue))
    except (psycopg.OperationalError, RuntimeFailure):
        return
    if not all(t in at_root for t in wanted):
        return  # not on the root either: the add says so

    def outstanding() -> str | None:
        lacking = [t for t in wanted if t not in listed(prov, queue)]
        return f"the provider does not list {', '.join(lacking)} yet" if lacking else None

    wait_for(f"the {kind} added on the root to reach the provider", outstanding, timeout, say)
