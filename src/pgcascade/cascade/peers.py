"""Two-way replication: masters that are peers of each other (docs/two-way.md).

Every master is the root of its own queue.  `add-peer` makes it a subscriber of another
master's queue as well: a node row of that queue here (`peer_of` = this master's queue), its
consumer registered there, and this master's tables subscribed in state ok (every master holds
the same rows; a table the peer adds later is in its set then).  The worker of the master
replays every peer's queue (replica/worker.py).  A table added later that is empty here and
has rows on a peer is copied from it (replica/copy.py: CopyProcess.copied_from_peer).
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade.join import ensure_registered, registered_on
from pgcascade.core import pgconn, privileges
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.pgq.node import NodeType
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber
from pgcascade.replica.conflicts import ConflictPolicy

SEQUENCE_STEP = 10  # a two-way sequence: each master takes every 10th value (room for 10 masters)


def require_commit_timestamps(conn: psycopg.Connection, where: str) -> None:
    """Conflicts are resolved by the changes' commit times: both masters must record them."""
    row = conn.execute("show track_commit_timestamp").fetchone()
    if not row or row[0] != "on":
        raise UserError(
            f"{where} runs with track_commit_timestamp = off: two-way replication needs it on"
            " (set it in postgresql.conf and restart that server)"
        )


def peer_queue(prov: psycopg.Connection, peer: str) -> str:
    """The queue the master `peer` at that location is the root of."""
    row = prov.execute(
        "select queue_name from pgcascade.node where node_type = 'root' and node_name = %s and peer_of is null",
        (peer,),
    ).fetchone()
    if row is None:
        raise UserError(f"no master named {peer!r} at that location: run create-root {peer} there first")
    return row[0]


def add_peer(
    conn: psycopg.Connection, own_queue: str, peer: str, location: str, policy: ConflictPolicy
) -> bool:
    """Subscribe this master to master `peer`'s queue; False if it was already (its location
    and policy are updated then)."""
    me = nodes.require_node(conn, own_queue)
    if not me.role.is_root:
        raise UserError(
            f"this node is a {me.node_type} of {own_queue}: add-peer is for masters (create-root)"
        )
    if peer == me.node_name:
        raise UserError(f"{peer} is this master's own name")
    require_commit_timestamps(conn, "this master")
    policy.check_function(conn)
    with_origins = logical.is_logical(conn, own_queue)  # the apply marks peers' changes with origins
    privileges.require(
        conn,
        privileges.replica_role(conn),
        privileges.owner_of(conn, list(set_tables.set_tables(conn, own_queue))),
        privileges.replication_origins(conn) if with_origins else None,
    )
    own_location = nodes.node_location(conn, own_queue, me.node_name)
    with pgconn.connect(location, autocommit=True, connect_timeout=10) as prov:
        privileges.require(prov, privileges.schema(prov, installs=False), where=f"on master {peer}")
        require_commit_timestamps(prov, f"master {peer}")
        queue = peer_queue(prov, peer)
        if queue == own_queue:
            raise UserError(
                f"master {peer} is the root of queue {queue!r} too: every master needs a queue of its own"
            )
        existing = nodes.get_node(conn, queue)
        if existing is not None:
            if existing.peer_of != own_queue:
                raise UserError(
                    f"this database is already node {existing.node_name} of {queue}: not a peer of it"
                )
            with conn.transaction():
                nodes.set_location(conn, queue, peer, location)
                nodes.set_conflict_policy(conn, queue, str(policy))
            ensure_registered(conn, existing)
            return False
        ours = set_tables.set_tables(conn, own_queue)
        refuse_unequal_tables(conn, prov, queue, peer, ours)
        # the peer's registration commits after this master's record (join.registered_on)
        with registered_on(prov, queue, me.node_name, own_location) as position, conn.transaction():
            nodes.insert_node(
                conn,
                queue,
                me.node_name,
                NodeType.LEAF,
                peer,
                position[0],
                peer_of=own_queue,
                conflict_policy=str(policy),
            )
            nodes.set_location(conn, queue, peer, location)
            nodes.set_location(conn, queue, me.node_name, own_location)
            subscriber.subscribe_peer_tables(conn, queue, ours)
            if with_origins:
                logical.ensure_origin(conn, logical.peer_origin(peer))
            for table, keys in ours.items():
                set_tables.make_two_way(conn, table, keys)
    return True


def refuse_unequal_tables(
    conn: psycopg.Connection, prov: psycopg.Connection, peer_queue: str, peer: str, ours: dict[str, list[str]]
) -> None:
    """add-peer subscribes this master's tables as holding the peer's rows: a table empty here
    that the peer holds with rows would stay without them.  Such a table is copied by add-table
    once the masters are joined."""
    lacking = held_with_rows(prov, peer_queue, [t for t in ours if not has_rows(conn, t)])
    if lacking:
        raise UserError(
            f"{', '.join(lacking)} empty here and holding rows on master {peer}: remove-table it here,"
            " add the peer, then add-table it again (the worker copies it from a peer)"
        )


def tables_added(conn: psycopg.Connection, own_queue: str, added: list[str]) -> dict[str, str]:
    """add-table on a master with peers: the new tables are two-way, and subscribed from every
    peer.  A table empty here that a peer holds with rows is copied from that peer once (the
    first by name); the copy then has the other peers replay what it does not hold.  Returns
    table -> the peer it is copied from."""
    peer_nodes = nodes.peers(conn, own_queue)
    if not peer_nodes or not added:
        return {}
    ours = set_tables.set_tables(conn, own_queue)
    sources = copy_sources(conn, peer_nodes, [t for t in added if not has_rows(conn, t)])
    with conn.transaction():
        for table in added:
            set_tables.make_two_way(conn, table, ours[table])
        for p in peer_nodes:
            subscriber.subscribe_peer_tables(
                conn, p.queue_name, {t: ours[t] for t in added if t not in sources}
            )
            copied = {t: ours[t] for t, source in sources.items() if source == p.provider_node}
            subscriber.subscribe_peer_tables(conn, p.queue_name, copied, states.NEW)
    return sources


def has_rows(conn: psycopg.Connection, table: str) -> bool:
    return bool(scalar(conn, sql.SQL("select exists (select 1 from {})").format(sql.SQL(table))))


def held_with_rows(prov: psycopg.Connection, peer_queue: str, tables: list[str]) -> list[str]:
    """Those of `tables` that the master at `prov` has in its set (`peer_queue`) with rows."""
    theirs = set_tables.set_tables(prov, peer_queue)
    return [t for t in tables if t in theirs and has_rows(prov, t)]


def copy_sources(conn: psycopg.Connection, peer_nodes: list[nodes.Node], empty: list[str]) -> dict[str, str]:
    """For each table empty here: the first peer whose set holds it with rows."""
    sources: dict[str, str] = {}
    for p in peer_nodes:
        wanted = [t for t in empty if t not in sources]
        if not wanted:
            break
        with pgconn.connect(nodes.provider_location(conn, p), autocommit=True, connect_timeout=10) as prov:
            assert p.provider_node is not None
            sources.update(dict.fromkeys(held_with_rows(prov, p.queue_name, wanted), p.provider_node))
    return sources


def set_table_policy(
    conn: psycopg.Connection, own_queue: str, tables: list[str], policy: ConflictPolicy
) -> None:
    """The conflict policy of these tables, whichever peer the change comes from."""
    queues = [p.queue_name for p in nodes.peers(conn, own_queue)]
    if not queues:
        raise UserError("--conflict is for a two-way master: add its peers first (add-peer)")
    policy.check_function(conn)
    subscriber.set_peer_policy(conn, queues, tables, str(policy))


def sequence_state(conn: psycopg.Connection, seq: str) -> tuple[int, int]:
    """(increment, last value) of a sequence: the last handed out, or the next one (the value
    set) when none was since.  `seq` is a canonical name (catalog.canonical), quoted already."""
    if conn.execute("select to_regclass(%s)", (seq,)).fetchone() == (None,):
        raise UserError(f"sequence {seq} does not exist on every master")
    row = conn.execute(
        sql.SQL(
            "select s.increment_by, q.last_value from pg_sequences s, {} q"
            " where format('%%I.%%I', s.schemaname, s.sequencename) = %s"
        ).format(sql.SQL(seq)),
        (seq,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def spread_sequences(conn: psycopg.Connection, own_queue: str, seqs: list[str]) -> dict[str, int]:
    """add-seq on a master with peers: each sequence goes on in steps of SEQUENCE_STEP from a
    residue no peer's copy of it uses, past every value any master has handed out, so the masters'
    inserts never collide.  Returns the residue each sequence took here."""
    peer_nodes = nodes.peers(conn, own_queue)
    if not peer_nodes:
        return {}
    taken: dict[str, set[int]] = {s: set() for s in seqs}
    highest = {s: sequence_state(conn, s)[1] for s in seqs}
    for p in peer_nodes:
        with pgconn.connect(nodes.provider_location(conn, p), autocommit=True, connect_timeout=10) as prov:
            for s in seqs:
                step, last = sequence_state(prov, s)
                highest[s] = max(highest[s], last)
                if step == SEQUENCE_STEP:
                    taken[s].add(last % SEQUENCE_STEP)
    residues = {}
    with conn.transaction():
        for s in seqs:
            free = [r for r in (*range(1, SEQUENCE_STEP), 0) if r not in taken[s]]
            if not free:
                raise UserError(
                    f"sequence {s}: every one of its {SEQUENCE_STEP} residues is taken by a master"
                )
            r = free[0]
            start = highest[s] + 1 + (r - highest[s] - 1) % SEQUENCE_STEP
            conn.execute("select pgcascade.spread_sequence(%s::regclass, %s, %s)", (s, SEQUENCE_STEP, start))
            residues[s] = r
    return residues
