"""Takeover: another node becomes the root, with the old root alive (switchover) or lost
(failover).  Every step that changes one database is one transaction there; a multi-node
operation is ordered so that an interruption leaves each node consistent and the command can
be run again.

Switchover (`takeover OLD` with OLD the live root), with N the branch taking over:
  1. wait until N is at most three ticks behind OLD (writes still allowed);
  2. on OLD, one transaction: capture off, writes refused, a last tick T, OLD becomes a
     paused branch of N at T (its ticker stops: the queue takes its ticks from outside);
  3. wait until N applied T;
  4. on N, one transaction: it becomes the root, capture on, writes allowed;
  5. OLD is registered on N at T and resumed; N's registration on OLD is dropped.
Writes are refused from 2 to 4.  If N does not reach T in time, OLD is made the root again.
Before step 1, N must be able to take the application's writes (readiness.py; --force skips).

Failover (`takeover OLD --dead-root`): N first catches up from the most advanced surviving
branch (branches carry the whole queue), becomes the root, and every survivor that fed from
OLD moves to N.  A node that applied ticks no survivor carries cannot follow without a gap:
it is reported, with the ticks it has that the new root does not, and left alone.  Before N
becomes the root it records the watermark of every node about to follow it (and, for a node
that cannot be reached, the set's global watermark), so its first maintenance as the root
does not delete the ticks they continue from.

The tables change hands through their owners: capture.tables starts and stops capturing,
replica.tables adopts and releases them; this module only orders the steps.
"""

from __future__ import annotations

import time

import psycopg

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade import readiness
from pgcascade.cascade.join import announce_location
from pgcascade.cascade.provider import change_provider, forget_subscriber
from pgcascade.cascade.survey import Member, connect, last_tick_of, member_location, reach, reporters, survey
from pgcascade.cascade.waits import Say, wait_for
from pgcascade.core import privileges
from pgcascade.core.errors import RuntimeFailure, UserError
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber


def promote_to_root(conn: psycopg.Connection, queue: str, first_tick: int | None = None) -> list[str]:
    """Make this node the root, in one transaction: capture its tables, allow writes, tick.
    Tables of the set it does not hold in sync are left out of the set; their names return.
    `first_tick`: the id of its first own tick (after ticks other nodes saw and it did not)."""
    with conn.transaction():
        nodes.lock_node(conn, queue)
        if first_tick is not None:
            q.branch_tick(conn, queue, first_tick, None, None)
        q.set_queue_config(conn, queue, "external_ticker", "false")
        left_out = set_tables.start_capture(conn, queue, subscriber.in_sync_tables(conn, queue))
        set_tables.follow_seqs(conn, queue, subscriber.release_all(conn, queue, unprotect=False))
        nodes.become_root(conn, queue)
        set_tables.emit_table_list(conn, queue)
    return left_out


def demote_to_branch(conn: psycopg.Connection, queue: str, provider: str) -> int:
    """Make the root a paused branch of `provider`, in one transaction: capture off, writes
    refused, a last tick (returned); its queue takes its ticks from the provider from then on."""
    with conn.transaction():
        nodes.lock_node(conn, queue)
        subscriber.adopt(conn, queue, set_tables.stop_capture(conn, queue), states.OK)
        subscriber_seqs.follow_seqs(conn, queue, set_tables.set_seqs(conn, queue))
        tick = q.ticker(conn, queue)
        q.set_queue_config(conn, queue, "external_ticker", "true")
        nodes.become_branch(conn, queue, provider, tick)
    return tick


def refuse_logical_capture(conn: psycopg.Connection, queue: str, name: str, what: str) -> None:
    """A root capturing from WAL would go on decoding its own replayed changes into its queue
    once it is a branch: not supported yet (the old root must stop capturing first)."""
    if logical.is_logical(conn, queue):
        raise UserError(
            f"{name} captures from WAL (--capture=logical): {what} of such a root is not supported yet;"
            " use takeover --dead-root after stopping it, and recreate it as a branch"
        )


def wait_applied_tick(
    new: psycopg.Connection, queue: str, who: str, tick: int, say: Say, timeout: float
) -> None:
    def outstanding() -> str | None:
        applied = nodes.applied_tick(new, queue)
        return None if applied >= tick else f"at tick {applied}"

    wait_for(f"{who} to apply tick {tick}", outstanding, timeout, say)


def check_write_readiness(
    new: psycopg.Connection, old: psycopg.Connection | None, queue: str, say: Say, force: bool
) -> None:
    """Refuse (unless `force`) a new root the application could not write to (readiness.py)."""
    gaps = readiness.write_gaps(new, old, queue)
    if gaps and not force:
        raise UserError(readiness.refusal(gaps))
    for gap in gaps:
        say(f"warning (--force): {gap}")


def switchover(
    new: psycopg.Connection, queue: str, old_name: str, say: Say, timeout: float, force: bool = False
) -> str:
    """The branch `new` takes the live root's place; the old root becomes its branch."""
    me = nodes.require_node(new, queue)
    old_loc = member_location(new, queue, old_name)
    with connect(old_loc) as old:
        onode = nodes.require_node(old, queue)
        refuse_logical_capture(old, queue, old_name, "a switchover")
        # the old root becomes a branch: it applies from then on (core/privileges.py)
        privileges.require(
            old, privileges.replica_role(old), where=f"on {old_name}, the root that becomes a branch"
        )
        check_write_readiness(new, old, queue, say, force)

        def close_behind() -> str | None:
            # a few ticks: under load the root ticks every few tens of ms, each a batch to apply
            newest, mine = last_tick_of(old, queue) or 0, nodes.applied_tick(new, queue)
            return None if mine >= newest - 3 else f"{me.node_name} at tick {mine}, {old_name} at {newest}"

        wait_for(f"{me.node_name} to catch up with {old_name}", close_behind, timeout, say)
        last = demote_to_branch(old, queue, me.node_name)
        blocked = time.monotonic()
        say(f"{old_name}: writes refused, last tick {last}")
        try:
            wait_applied_tick(new, queue, me.node_name, last, say, timeout)
        except RuntimeFailure:
            promote_to_root(old, queue)  # back as it was: the old root takes writes again
            raise
        keep_history_for(new, queue, old_name, old, last)
        left_out = promote_to_root(new, queue)
        blocked = time.monotonic() - blocked
        with new.transaction():
            q.register_consumer_at(new, queue, onode.consumer, last)
            nodes.set_location(new, queue, old_name, old_loc)
        nodes.set_paused(old, queue, False)
        forget_subscriber(old, queue, me.node_name, me.worker_name)
    note = f"; left out of the set (not in sync here): {', '.join(left_out)}" if left_out else ""
    return (
        f"{me.node_name} is the root; {old_name} is its branch from tick {last};"
        f" writes were refused for {blocked:.2f}s{note}"
    )


def catch_up_from_best(
    new: psycopg.Connection, queue: str, live: list[Member], say: Say, timeout: float
) -> Member | None:
    """Failover, step 1: apply what the most advanced surviving branch has and we do not."""
    me = nodes.require_node(new, queue)
    mine = nodes.applied_tick(new, queue)
    ahead = [m for m in live if m.node and m.node.role.has_queue and (m.node.last_tick or 0) > mine]
    if not ahead:
        return None
    best = max(ahead, key=lambda m: (m.node.last_tick or 0) if m.node else 0)
    assert best.node is not None
    target = best.node.last_tick or 0
    say(f"catching up from {best.name} (tick {target}; here {mine})")
    change_provider(new, queue, best.name, say, timeout)
    wait_applied_tick(new, queue, f"{me.node_name} (from {best.name})", target, say, timeout)
    return best


def hold_history(
    new: psycopg.Connection, queue: str, dead_name: str, members: list[Member], mine: int
) -> tuple[list[Member], list[Member], set[str]]:
    """Failover, step 2: before `new` is the root, keep the ticks every node that will follow
    it needs; returns (followers, unreachable members, nodes below the survivors)."""
    me = nodes.require_node(new, queue).node_name
    live = [m for m in members if m.node is not None]
    followers = [
        m
        for m in live
        if m.node is not None
        and m.node.provider_node in (dead_name, me)
        and m.node.role.reads_provider_queue
        and (m.node.last_tick or 0) <= mine
    ]
    for m in followers:
        with reach(m.location) as mc:
            keep_history_for(new, queue, m.name, mc, m.node.last_tick if m.node else None)
    unreachable = [m for m in members if m.node is None and not m.dead and m.name != dead_name]
    under_survivors: set[str] = set()
    for m in live:
        if m.node is not None and m.node.role.has_queue:
            under_survivors |= reporters(m.location, queue)
    for m in unreachable:  # it may have fed from OLD, come back and move here: keep its history
        if m.name not in under_survivors:
            keep_history_for(new, queue, m.name, None, nodes.global_watermark(new, queue))
    return followers, unreachable, under_survivors


def failover(
    new: psycopg.Connection, queue: str, dead_name: str, say: Say, timeout: float, force: bool = False
) -> str:
    """The root is lost: this branch becomes the root, after catching up from the most
    advanced surviving branch, and every survivor that fed from the dead root follows it."""
    me = nodes.require_node(new, queue)
    if not me.role.has_queue:
        raise UserError(f"{me.node_name} is a leaf: only a branch can become the root")
    dead_loc = member_location(new, queue, dead_name)
    with reach(dead_loc) as c:
        if c is not None and (n := nodes.get_node(c, queue)) is not None and n.role.is_root:
            raise UserError(f"{dead_name} answers and is the root: use takeover without --dead-root")
    members = [m for m in survey(new, queue, skip=(dead_name,)) if m.name != me.node_name]
    live = [m for m in members if m.node is not None]
    best = catch_up_from_best(new, queue, live, say, timeout)
    check_write_readiness(new, None, queue, say, force)  # refused: a branch of `best`, as before
    mine = nodes.applied_tick(new, queue)
    seen = max([mine, *((m.node.last_tick or 0) for m in live if m.node)])
    followers, unreachable, under_survivors = hold_history(new, queue, dead_name, members, mine)
    left_out = promote_to_root(new, queue, first_tick=seen + 1 if seen > mine else None)
    announce_location(new, queue, dead_name, dead_loc, dead=True)
    report = [f"{me.node_name} is the root from tick {mine}"]
    if left_out:
        report.append(f"left out of the set (not in sync here): {', '.join(left_out)}")
    for m in live:
        assert m.node is not None
        if m.node.provider_node not in (dead_name, me.node_name) or not m.node.role.reads_provider_queue:
            continue
        if m not in followers:
            report.append(
                f"{m.name} applied ticks {mine + 1}..{m.node.last_tick} that no survivor carries:"
                f" left on {dead_name}; resync its tables (or drop it)"
            )
        elif m.node.provider_node != me.node_name:
            with connect(m.location) as mc:
                report.append(change_provider(mc, queue, me.node_name, say, timeout))
    if best is not None:
        with reach(best.location) as bc:
            if bc is not None:
                forget_subscriber(bc, queue, me.node_name, me.worker_name)
    for m in unreachable:
        kept = (
            ""
            if m.name in under_survivors
            else f": {me.node_name} keeps history for it until it moves here (change-provider) or is dropped (drop-node)"
        )
        report.append(f"{m.name}: unreachable ({m.error}); not redirected{kept}")
    return "\n".join(report)


def keep_history_for(
    new: psycopg.Connection, queue: str, name: str, conn: psycopg.Connection | None, last_tick: int | None
) -> None:
    """Before `new` becomes the root: keep its ticks back to what node `name` (reached through
    `conn`, None if it cannot be) and the nodes below it still need, as if it had reported it
    already.  Otherwise the new root's first maintenance computes the global watermark from
    its own reporters only and deletes the ticks a node about to move to it continues from."""
    wm = nodes.local_watermark(conn, queue) if conn is not None else None
    known = [t for t in (wm, last_tick) if t is not None]
    if known:
        nodes.set_subscriber_watermark(new, queue, name, min(known))
