"""The set as a whole: members, the tree, moving subscribers, takeover, dropping nodes.

Each command runs where the user runs it and reaches the other nodes through the locations
this node stores (they travel as `pgcascade.location` events from the root).  Every step that
changes one database is one transaction there; a multi-node operation is ordered so that an
interruption leaves each node consistent and the command can be run again.

Switchover (`takeover OLD` with OLD the live root), with N the branch taking over:
  1. wait until N is at most three ticks behind OLD (writes still allowed);
  2. on OLD, one transaction: capture off, writes refused, a last tick T, OLD becomes a
     paused branch of N at T (its ticker stops: the queue takes its ticks from outside);
  3. wait until N applied T;
  4. on N, one transaction: it becomes the root, capture on, writes allowed;
  5. OLD is registered on N at T and resumed; N's registration on OLD is dropped.
Writes are refused from 2 to 4.  If N does not reach T in time, OLD is made the root again.

Failover (`takeover OLD --dead-root`): N first catches up from the most advanced surviving
branch (branches carry the whole queue), becomes the root, and every survivor that fed from
OLD moves to N.  A node that applied ticks no survivor carries cannot follow without a gap:
it is reported, with the ticks it has that the new root does not, and left alone.  Before N
becomes the root it records the watermark of every node about to follow it (and, for a node
that cannot be reached, the set's global watermark), so its first maintenance as the root
does not delete the ticks they continue from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pgcascade.capture import tables as capture
from pgcascade.core import pgconn
from pgcascade.core.errors import RuntimeFailure, UserError, db_error_line
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import tables as subscriber

REPORT_EVERY = 10.0  # seconds between "still waiting for ..." lines (seed 004's slonik habit)


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


def wait_for(
    what: str,
    done: Callable[[], str | None],
    timeout: float,
    say: Callable[[str], None],
    no_wait: bool = False,
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
        time.sleep(0.05)


# --- what every node knows ----------------------------------------------------------------------


@dataclass
class Member:
    name: str
    location: str
    dead: bool
    node: nodes.Node | None = None  # read from the node itself; None when unreachable
    error: str | None = None


def locations(conn: psycopg.Connection, queue: str) -> dict[str, tuple[str, bool]]:
    return {
        name: (loc, dead)
        for name, loc, dead in conn.execute(
            "select node_name, node_location, dead from pgcascade.node_location where queue_name = %s order by 1",
            (queue,),
        )
    }


def survey(conn: psycopg.Connection, queue: str, skip: tuple[str, ...] = ()) -> list[Member]:
    """Every known node, each read from its own database when reachable."""
    out = []
    for name, (loc, dead) in locations(conn, queue).items():
        m = Member(name, loc, dead)
        if name not in skip:
            try:
                with connect(loc, timeout=3) as c:
                    m.node = nodes.get_node(c, queue)
                    if m.node is None or m.node.node_name != name:
                        m.node, m.error = None, "not a node of the set"
            except psycopg.Error as e:
                m.error = db_error_line(e)
        out.append(m)
    return out


def find_root(conn: psycopg.Connection, queue: str) -> tuple[str, str]:
    """(name, location) of the set's root, found by following providers upward."""
    node = nodes.require_node(conn, queue)
    seen = set()
    current, here = node, conn
    opened: list[psycopg.Connection] = []
    try:
        while current.node_type != "root":
            if current.node_name in seen or not current.provider_node:
                raise RuntimeFailure(f"no root above node {node.node_name}")
            seen.add(current.node_name)
            loc = nodes.node_location(here, queue, current.provider_node)
            here = connect(loc)
            opened.append(here)
            nxt = nodes.get_node(here, queue)
            if nxt is None:
                raise RuntimeFailure(f"provider {current.provider_node} is not a node of {queue}")
            current = nxt
        return current.node_name, nodes.node_location(conn, queue, current.node_name)
    finally:
        for c in opened:
            c.close()


def announce_location(
    root: psycopg.Connection, queue: str, name: str, location: str | None, dead: bool = False
) -> None:
    """On the root: store a node's location (None: the node left) and send it down the set."""
    with root.transaction():
        if location is None:
            root.execute(
                "delete from pgcascade.node_location where queue_name = %s and node_name = %s", (queue, name)
            )
        else:
            nodes.set_location(root, queue, name, location)
            if dead:
                root.execute(
                    "update pgcascade.node_location set dead = true where queue_name = %s and node_name = %s",
                    (queue, name),
                )
        root.execute(
            "select pgcascade.insert_event(%s, 'pgcascade.location', %s, %s, %s, null, null)",
            (queue, name, location, "dead" if dead else None),
        )


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


def last_tick_of(conn: psycopg.Connection, queue: str) -> int | None:
    """The newest tick of this node's queue, or (a leaf) the last tick it applied."""
    node = nodes.require_node(conn, queue)
    if node.role.has_queue:
        return conn.execute("select last_tick_id from pgcascade.get_queue_info(%s)", (queue,)).fetchone()[0]
    return node.last_tick


def global_watermark(conn: psycopg.Connection, queue: str) -> int | None:
    """The oldest tick this node keeps for the set (its '.global_watermark' registration)."""
    row = conn.execute(
        "select last_tick from pgcascade.get_consumer_info(%s, '.global_watermark')", (queue,)
    ).fetchone()
    return row[0] if row else None


def reporters(location: str, queue: str) -> set[str]:
    """The nodes that report their watermark to the node at `location`: its subscribers."""
    with reach(location) as c:
        if c is None:
            return set()
        rows = c.execute("select node_name from pgcascade.node_watermark where queue_name = %s", (queue,))
        return {r[0] for r in rows}


def has_tick(conn: psycopg.Connection, queue: str, tick: int) -> bool:
    return conn.execute(
        "select exists (select 1 from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue"
        " where q.queue_name = %s and t.tick_id = %s)",
        (queue, tick),
    ).fetchone()[0]


# --- moving a subscriber --------------------------------------------------------------------------


def feeds_from(conn: psycopg.Connection, queue: str, name: str, ancestor: str) -> bool:
    """Whether node `name` (read through `conn`'s locations) is `ancestor` or below it."""
    known = locations(conn, queue)
    seen = set()
    current = name
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


def change_provider(
    sub: psycopg.Connection,
    queue: str,
    new_provider: str,
    say: Callable[[str], None],
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
    busy = [t.table_name for t in subscriber.tables(sub, queue) if t.state not in (None, "ok")]
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
            tick = sub.execute(
                "select last_tick from pgcascade.node where queue_name = %s for update", (queue,)
            ).fetchone()[0]

            def reached() -> str | None:
                newest = last_tick_of(prov, queue) or 0
                return (
                    None
                    if newest >= tick
                    else f"{new_provider} is at tick {newest}, {node.node_name} at {tick}"
                )

            wait_for(f"{new_provider} to reach tick {tick}", reached, timeout, say, no_wait)
            if not has_tick(prov, queue, tick):
                raise RuntimeFailure(
                    f"{new_provider} no longer has tick {tick} (deleted behind its watermark):"
                    f" {node.node_name} cannot continue from it without a gap; resync its tables instead"
                )
            with prov.transaction():
                prov.execute(
                    "select pgcascade.register_consumer_at(%s, %s, %s)", (queue, node.worker_name, tick)
                )
                nodes.set_location(
                    prov, queue, node.node_name, nodes.node_location(sub, queue, node.node_name)
                )
            sub.execute(
                "update pgcascade.node set provider_node = %s where queue_name = %s", (new_provider, queue)
            )
    old = node.provider_node
    old_loc = locations(sub, queue).get(old) if old else None
    if old_loc is not None:
        with reach(old_loc[0]) as oldc:
            if oldc is not None:
                forget_subscriber(oldc, queue, node.node_name, node.worker_name)
    return f"{node.node_name} feeds from {new_provider} at tick {tick} (was {old})"


def forget_subscriber(conn: psycopg.Connection, queue: str, name: str, consumer: str | None) -> None:
    """A provider stops keeping history for a subscriber that left it."""
    with conn.transaction():
        conn.execute(
            "select pgcascade.unregister_consumer(%s, s.consumer_name) from pgcascade.get_consumer_info(%s) s"
            " where s.consumer_name = %s or starts_with(s.consumer_name, %s)",
            (queue, queue, consumer or name, f"{consumer or name}.copy."),
        )
        conn.execute(
            "delete from pgcascade.node_watermark where queue_name = %s and node_name = %s", (queue, name)
        )


# --- node types changing ---------------------------------------------------------------------


def promote_to_root(conn: psycopg.Connection, queue: str, first_tick: int | None = None) -> list[str]:
    """Make this node the root, in one transaction: capture its tables, allow writes, tick.
    Tables of the set it does not hold in sync are left out of the set; their names return.
    `first_tick`: the id of its first own tick (after ticks other nodes saw and it did not)."""
    left_out = []
    with conn.transaction():
        conn.execute("select 1 from pgcascade.node where queue_name = %s for update", (queue,))
        if first_tick is not None:
            conn.execute("select pgcascade.branch_tick(%s, %s, now(), null)", (queue, first_tick))
        conn.execute("select pgcascade.set_queue_config(%s, 'external_ticker', 'false')", (queue,))
        held = {t.table_name: t for t in subscriber.tables(conn, queue)}
        for table, keys, fmt in conn.execute(
            "select table_name, key_columns, event_format from pgcascade.set_table where queue_name = %s",
            (queue,),
        ).fetchall():
            t = held.get(table)
            if t is None or t.state != "ok" or t.dest_table != table or not _exists(conn, table):
                left_out.append(table)
                conn.execute(
                    "delete from pgcascade.set_table where queue_name = %s and table_name = %s",
                    (queue, table),
                )
                continue
            conn.execute("select pgcascade.protect_table(%s::regclass, false)", (table,))
            conn.execute(
                "select pgcascade.capture_enable(%s, %s::regclass, %s, %s)", (queue, table, keys, fmt)
            )
        conn.execute(
            "insert into pgcascade.set_seq (queue_name, seq_name) select queue_name, seq_name"
            " from pgcascade.subscriber_seq where queue_name = %s on conflict do nothing",
            (queue,),
        )
        conn.execute("delete from pgcascade.subscriber_table where queue_name = %s", (queue,))
        conn.execute("delete from pgcascade.subscriber_seq where queue_name = %s", (queue,))
        conn.execute(
            "update pgcascade.node set node_type = 'root', provider_node = null, paused = false,"
            " root_since_tick = last_tick, last_error = null, last_error_time = null where queue_name = %s",
            (queue,),
        )
        capture.emit_table_list(conn, queue)
    return left_out


def demote_to_branch(conn: psycopg.Connection, queue: str, provider: str) -> int:
    """Make the root a paused branch of `provider`, in one transaction: capture off, writes
    refused, a last tick (returned); its queue takes its ticks from the provider from then on."""
    with conn.transaction():
        conn.execute("select 1 from pgcascade.node where queue_name = %s for update", (queue,))
        tables = conn.execute(
            "select table_name, key_columns from pgcascade.set_table where queue_name = %s", (queue,)
        ).fetchall()
        for table, keys in tables:
            if not _exists(conn, table):
                continue
            # the trigger DDL waits for writers in flight: after it, none is left
            conn.execute("select pgcascade.capture_disable(%s::regclass)", (table,))
            conn.execute("select pgcascade.protect_table(%s::regclass, true)", (table,))
            conn.execute(
                "insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns, state)"
                " values (%s, %s, %s, %s, 'ok') on conflict (queue_name, table_name) do update set state = 'ok'",
                (queue, table, table, keys),
            )
        conn.execute(
            "insert into pgcascade.subscriber_seq (queue_name, seq_name, dest_seq) select queue_name, seq_name,"
            " seq_name from pgcascade.set_seq where queue_name = %s on conflict do nothing",
            (queue,),
        )
        tick = q.ticker(conn, queue)
        conn.execute("select pgcascade.set_queue_config(%s, 'external_ticker', 'true')", (queue,))
        conn.execute(
            "update pgcascade.node set node_type = 'branch', provider_node = %s, last_tick = %s, paused = true,"
            " worker_name = coalesce(worker_name, node_name) where queue_name = %s",
            (provider, tick, queue),
        )
    return tick


def _exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("select to_regclass(%s) is not null", (table,)).fetchone()[0]


def refuse_logical_capture(conn: psycopg.Connection, queue: str, name: str, what: str) -> None:
    """A root capturing from WAL would go on decoding its own replayed changes into its queue
    once it is a branch: not supported yet (the old root must stop capturing first)."""
    from pgcascade.capture import logical as walcapture

    if walcapture.is_logical(conn, queue):
        raise UserError(
            f"{name} captures from WAL (--capture=logical): {what} of such a root is not supported yet;"
            " use takeover --dead-root after stopping it, and recreate it as a branch"
        )


def applied_tick(conn: psycopg.Connection, queue: str) -> int:
    return (
        conn.execute("select last_tick from pgcascade.node where queue_name = %s", (queue,)).fetchone()[0]
        or 0
    )


# --- takeover ---------------------------------------------------------------------------------------


def switchover(
    new: psycopg.Connection, queue: str, old_name: str, say: Callable[[str], None], timeout: float
) -> str:
    """The branch `new` takes the live root's place; the old root becomes its branch."""
    me = nodes.require_node(new, queue)
    old_loc = member_location(new, queue, old_name)
    with connect(old_loc) as old:
        onode = nodes.require_node(old, queue)
        refuse_logical_capture(old, queue, old_name, "a switchover")

        def close_behind() -> str | None:
            # a few ticks: under load the root ticks every few tens of ms, each a batch to apply
            newest, mine = last_tick_of(old, queue) or 0, applied_tick(new, queue)
            return None if mine >= newest - 3 else f"{me.node_name} at tick {mine}, {old_name} at {newest}"

        wait_for(f"{me.node_name} to catch up with {old_name}", close_behind, timeout, say)
        last = demote_to_branch(old, queue, me.node_name)
        blocked = time.monotonic()
        say(f"{old_name}: writes refused, last tick {last}")
        try:
            wait_for(
                f"{me.node_name} to apply tick {last}",
                lambda: None if applied_tick(new, queue) >= last else f"at tick {applied_tick(new, queue)}",
                timeout,
                say,
            )
        except RuntimeFailure:
            promote_to_root(old, queue)  # back as it was: the old root takes writes again
            raise
        keep_history_for(new, queue, old_name, old, last)
        left_out = promote_to_root(new, queue)
        blocked = time.monotonic() - blocked
        with new.transaction():
            new.execute(
                "select pgcascade.register_consumer_at(%s, %s, %s)",
                (queue, onode.worker_name or old_name, last),
            )
            nodes.set_location(new, queue, old_name, old_loc)
        old.execute("update pgcascade.node set paused = false where queue_name = %s", (queue,))
        forget_subscriber(old, queue, me.node_name, me.worker_name)
    note = f"; left out of the set (not in sync here): {', '.join(left_out)}" if left_out else ""
    return (
        f"{me.node_name} is the root; {old_name} is its branch from tick {last};"
        f" writes were refused for {blocked:.2f}s{note}"
    )


def failover(
    new: psycopg.Connection, queue: str, dead_name: str, say: Callable[[str], None], timeout: float
) -> str:
    """The root is lost: this branch becomes the root, after catching up from the most
    advanced surviving branch, and every survivor that fed from the dead root follows it."""
    me = nodes.require_node(new, queue)
    if not me.role.has_queue:
        raise UserError(f"{me.node_name} is a leaf: only a branch can become the root")
    dead_loc = member_location(new, queue, dead_name)
    with reach(dead_loc) as c:
        if c is not None and (n := nodes.get_node(c, queue)) is not None and n.node_type == "root":
            raise UserError(f"{dead_name} answers and is the root: use takeover without --dead-root")
    members = [m for m in survey(new, queue, skip=(dead_name,)) if m.name != me.node_name]
    live = [m for m in members if m.node is not None]
    mine = applied_tick(new, queue)
    ahead = [m for m in live if m.node.role.has_queue and (m.node.last_tick or 0) > mine]
    if ahead:
        best = max(ahead, key=lambda m: m.node.last_tick or 0)
        target = best.node.last_tick or 0
        say(f"catching up from {best.name} (tick {target}; here {mine})")
        change_provider(new, queue, best.name, say, timeout)
        wait_for(
            f"{me.node_name} to apply tick {target} from {best.name}",
            lambda: None if applied_tick(new, queue) >= target else f"at tick {applied_tick(new, queue)}",
            timeout,
            say,
        )
        mine = applied_tick(new, queue)
    seen = max([mine, *((m.node.last_tick or 0) for m in live)])
    followers = [
        m
        for m in live
        if m.node.provider_node in (dead_name, me.node_name)
        and m.node.role.reads_provider_queue
        and (m.node.last_tick or 0) <= mine
    ]
    for m in followers:
        with reach(m.location) as mc:
            keep_history_for(new, queue, m.name, mc, m.node.last_tick)
    unreachable = [m for m in members if m.node is None and not m.dead and m.name != dead_name]
    under_survivors = set().union(*(reporters(m.location, queue) for m in live if m.node.role.has_queue))
    for m in unreachable:  # it may have fed from OLD, come back and move here: keep its history
        if m.name not in under_survivors:
            keep_history_for(new, queue, m.name, None, global_watermark(new, queue))
    left_out = promote_to_root(new, queue, first_tick=seen + 1 if seen > mine else None)
    announce_location(new, queue, dead_name, dead_loc, dead=True)
    report = [f"{me.node_name} is the root from tick {mine}"]
    if left_out:
        report.append(f"left out of the set (not in sync here): {', '.join(left_out)}")
    for m in live:
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
    if ahead:
        with reach(best.location) as bc:
            if bc is not None:
                forget_subscriber(bc, queue, me.node_name, me.worker_name)
    for m in unreachable:
        kept = (
            ""
            if m.name in under_survivors
            else f": {me.node_name} keeps history for it until it moves here (change-provider)"
            " or is dropped (drop-node)"
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
    wm = conn.execute("select pgcascade.local_watermark(%s)", (queue,)).fetchone()[0] if conn else None
    known = [t for t in (wm, last_tick) if t is not None]
    if known:
        new.execute("select pgcascade.set_subscriber_watermark(%s, %s, %s)", (queue, name, min(known)))


def take_subscribers(
    new: psycopg.Connection, queue: str, old_name: str, dead: bool, say: Callable[[str], None], timeout: float
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


def member_location(conn: psycopg.Connection, queue: str, name: str) -> str:
    """The location of a member of the set, or a one-line error naming the command that lists them."""
    loc = locations(conn, queue).get(name)
    if loc is None:
        raise UserError(f"node {name!r} is not a member of set {queue!r} (see members)")
    return loc[0]


# --- dropping, pausing -----------------------------------------------------------------------------


def release_everywhere(conn: psycopg.Connection, queue: str, name: str) -> None:
    """Every reachable node with a queue stops keeping history for node `name`."""
    for m in survey(conn, queue, skip=(name,)):
        if m.node is not None and m.node.role.has_queue:
            with reach(m.location) as c:
                if c is not None:
                    forget_subscriber(c, queue, name, name)


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
    if (
        target is not None
        and target.node is not None
        and target.node.node_type == "root"
        and len(members) > 1
    ):
        raise UserError(f"{name} is the root: take it over first (takeover), then drop it")
    release_everywhere(conn, queue, name)
    with reach(loc) as c:
        if c is not None and nodes.get_node(c, queue) is not None:
            leave_set(c, queue)
    if not announce_at_root(conn, queue, name, None):
        conn.execute(
            "delete from pgcascade.node_location where queue_name = %s and node_name = %s", (queue, name)
        )
        return f"dropped {name} (the root is unreachable: other nodes still list its location)"
    return f"dropped {name}"


def leave_set(conn: psycopg.Connection, queue: str) -> None:
    """This database stops being a node of the set; its tables and their rows stay, writable."""
    with conn.transaction():
        for t in subscriber.tables(conn, queue):
            if _exists(conn, t.dest_table):
                conn.execute("select pgcascade.protect_table(%s::regclass, false)", (t.dest_table,))
        for table in [
            r[0]
            for r in conn.execute(
                "select table_name from pgcascade.set_table where queue_name = %s", (queue,)
            )
        ]:
            if _exists(conn, table):
                conn.execute("select pgcascade.capture_disable(%s::regclass)", (table,))
        for tbl in (
            "subscriber_table",
            "subscriber_seq",
            "set_table",
            "set_seq",
            "node_location",
            "node_watermark",
            "node",
        ):
            conn.execute(f"delete from pgcascade.{tbl} where queue_name = %s", (queue,))
        if conn.execute(
            "select exists (select 1 from pgcascade.queue where queue_name = %s)", (queue,)
        ).fetchone()[0]:
            q.drop_queue(conn, queue, force=True)


def set_paused(conn: psycopg.Connection, queue: str, name: str, paused: bool) -> str:
    """Pause or resume a node's worker, through the node's own database."""
    me = nodes.require_node(conn, queue)
    loc = None if name == me.node_name else member_location(conn, queue, name)
    with contextlib.ExitStack() as stack:
        target = conn if loc is None else stack.enter_context(connect(loc))
        n = nodes.require_node(target, queue)
        target.execute("update pgcascade.node set paused = %s where queue_name = %s", (paused, queue))
    return f"{n.node_name}: {'paused' if paused else 'resumed'}"


# --- the tree -----------------------------------------------------------------------------------------


def tree_rows(conn: psycopg.Connection, queue: str) -> tuple[list[Member], dict[str, dict]]:
    """Every member, and for the reachable ones: lag behind the root in ticks and time."""
    members = survey(conn, queue)
    root = next((m for m in members if m.node is not None and m.node.node_type == "root"), None)
    info: dict[str, dict] = {}
    if root is None:
        return members, info
    with reach(root.location) as rc:
        if rc is None:
            return members, info
        newest = last_tick_of(rc, queue) or 0
        for m in members:
            if m.node is None:
                continue
            tick = newest if m.node.node_type == "root" else (m.node.last_tick or 0)
            lag = rc.execute(
                "select now() - t.tick_time from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue"
                " where q.queue_name = %s and t.tick_id = %s",
                (queue, tick),
            ).fetchone()
            info[m.name] = {"tick": tick, "behind": max(newest - tick, 0), "lag": lag[0] if lag else None}
    return members, info


# --- waiting on purpose -----------------------------------------------------------------------------


def wait_applied(conn: psycopg.Connection, queue: str, tick: int, what: str, say, timeout: float) -> None:
    wait_for(
        f"{what} (tick {tick})",
        lambda: None if applied_tick(conn, queue) >= tick else f"applied tick {applied_tick(conn, queue)}",
        timeout,
        say,
    )


def wait_root(conn: psycopg.Connection, queue: str, say, timeout: float) -> int:
    """Wait until this node applied everything committed on the root before now."""
    me = nodes.require_node(conn, queue)
    if me.node_type == "root":
        return last_tick_of(conn, queue) or 0
    _, loc = find_root(conn, queue)
    with connect(loc) as root:
        tick = q.ticker(root, queue)
    wait_applied(conn, queue, tick, "the root's changes to arrive here", say, timeout)
    return tick


def wait_provider(conn: psycopg.Connection, queue: str, say, timeout: float) -> int:
    """Wait until this node applied every tick its provider has now."""
    me = nodes.require_node(conn, queue)
    with connect(nodes.provider_location(conn, me)) as prov:
        tick = last_tick_of(prov, queue) or 0
    wait_applied(conn, queue, tick, f"{me.provider_node}'s ticks to be applied here", say, timeout)
    return tick


def wait_provider_has_tables(
    conn: psycopg.Connection, prov: psycopg.Connection, queue: str, names: list[str], say, timeout: float
) -> None:
    """Tables just added on the root reach a branch's table list with the queue: wait for them
    there (seed 004: a command waits for the work it depends on), if the root has them."""
    from pgcascade.core import catalog

    wanted = [catalog.canonical(prov, n) for n in names]
    if all(t in capture.set_tables(prov, queue) for t in wanted):
        return
    try:
        _, loc = find_root(conn, queue)
        with connect(loc) as root:
            at_root = set(capture.set_tables(root, queue))
    except (psycopg.OperationalError, RuntimeFailure):
        return
    if not all(t in at_root for t in wanted):
        return  # not on the root either: add_tables says so

    def outstanding() -> str | None:
        lacking = [t for t in wanted if t not in capture.set_tables(prov, queue)]
        return f"the provider does not list {', '.join(lacking)} yet" if lacking else None

    wait_for("the tables added on the root to reach the provider", outstanding, timeout, say)


# --- an old root comes back ------------------------------------------------------------------------


def resurrect(conn: psycopg.Connection, queue: str, location: str, lost_file: Path, say) -> str:
    """This database was the root, was taken over while it was lost, and answers again: write
    the events it has that never reached the set (after the tick the new root took over from) to
    `lost_file`, one JSON object per line, then make it a branch of the new root whose tables are
    copied again (its own rows may hold those lost changes)."""
    me = nodes.require_node(conn, queue)
    if me.node_type != "root":
        raise UserError(f"{me.node_name} is the {me.node_type}: only an old root is resurrected")
    refuse_logical_capture(conn, queue, me.node_name, "resurrect")
    roots = [m for m in survey(conn, queue, skip=(me.node_name,)) if m.node and m.node.node_type == "root"]
    if not roots:
        raise UserError(f"no other node of {queue} is the root: {me.node_name} still is")
    new_root = roots[0]
    with connect(new_root.location) as rc:
        since = rc.execute(
            "select root_since_tick from pgcascade.node where queue_name = %s", (queue,)
        ).fetchone()[0]
    if since is None:
        raise RuntimeFailure(f"{new_root.name} does not record where it took over: cannot tell what was lost")
    lost = write_lost_events(conn, queue, since, lost_file)
    tables = conn.execute(
        "select table_name from pgcascade.set_table where queue_name = %s order by 1", (queue,)
    ).fetchall()
    seqs = conn.execute("select seq_name from pgcascade.set_seq where queue_name = %s", (queue,)).fetchall()
    leave_set(conn, queue)
    nodes.create_subscriber(conn, queue, me.node_name, "branch", location, new_root.location)
    with connect(new_root.location) as rc:
        announce_location(rc, queue, me.node_name, location)
        in_set = capture.set_tables(rc, queue)
        with conn.transaction():
            for (t,) in tables:
                if t in in_set and _exists(conn, t):
                    conn.execute(
                        "insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns)"
                        " select queue_name, table_name, table_name, key_columns from pgcascade.set_table"
                        " where queue_name = %s and table_name = %s",
                        (queue, t),
                    )
                    conn.execute("select pgcascade.protect_table(%s::regclass, true)", (t,))
            for (sq,) in seqs:
                conn.execute(
                    "insert into pgcascade.subscriber_seq (queue_name, seq_name, dest_seq) values (%s, %s, %s)",
                    (queue, sq, sq),
                )
    say(f"{lost} events that never reached the set written to {lost_file}")
    return f"{me.node_name} is a branch of {new_root.name}; its tables are copied again from there"


def write_lost_events(conn: psycopg.Connection, queue: str, since: int, path: Path) -> int:
    """Every event of this queue after tick `since` (a last tick first takes in those not ticked
    yet), streamed to `path` as JSON lines, in event order."""
    import json

    q.ticker(conn, queue)
    probe = ".resurrect"
    if not has_tick(conn, queue, since):
        raise RuntimeFailure(
            f"tick {since} is no longer in this node's queue: the lost events cannot be read"
        )
    conn.execute("select pgcascade.register_consumer_at(%s, %s, %s)", (queue, probe, since))
    n = 0
    with path.open("w") as out:
        while True:
            batch = conn.execute("select pgcascade.next_batch(%s, %s)", (queue, probe)).fetchone()[0]
            if batch is None:
                break
            with conn.transaction(), conn.cursor(name="lost") as cur:
                cur.execute(
                    "select ev_id, ev_time::text, ev_txid, ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3,"
                    " ev_extra4 from pgcascade.get_batch_events(%s) order by ev_id",
                    (batch,),
                )
                for row in cur:
                    keys = (
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
                    out.write(json.dumps(dict(zip(keys, row, strict=True))) + "\n")
                    n += 1
            conn.execute("select pgcascade.finish_batch(%s)", (batch,))
    q.unregister_consumer(conn, queue, probe)
    return n


# --- combined partitions ------------------------------------------------------------------------------


def register_merged_tables(conn: psycopg.Connection, combined: str, part: str, tables: list[str]) -> None:
    """Tables a merge-leaf applies become tables of the combined set (on its root: on a
    combined-failover branch the list comes from the root), announced with a table-list event."""
    cnode = nodes.get_node(conn, combined)
    if cnode is None or cnode.node_type != "root":
        return
    with conn.transaction():
        for t in tables:
            conn.execute(
                "insert into pgcascade.set_table (queue_name, table_name, key_columns)"
                " select %s, table_name, key_columns from pgcascade.subscriber_table"
                " where queue_name = %s and table_name = %s on conflict do nothing",
                (combined, part, t),
            )
        capture.emit_table_list(conn, combined)
