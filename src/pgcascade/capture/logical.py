"""Logical capture on the root, set-up: the publication, the slot, and the tables in it.

A root created with `--capture=logical` has a publication (its tables) and a logical
replication slot with the pgoutput plugin; no trigger runs in the application's transactions.
The capture daemon (daemon.py) reads the slot into the queue exactly once.  This module makes
and inspects that set-up (`pgcascade.walcapture`, whose position and last error only the
daemon writes).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import zlib
from dataclasses import dataclass

import psycopg
from psycopg import sql

from pgcascade.core.errors import RuntimeFailure, UserError, db_error_line
from pgcascade.core.pgconn import one, scalar
from pgcascade.pgq import node as nodes

log = logging.getLogger("pgcascade.capture")


# a two-way master's apply of peer P runs under the replication origin ORIGIN_PREFIX + P: the
# capture daemon tags what it made with P (no echo).  An origin is used by one session at a
# time: a copy process (a table's first copy from P, or its catch-up) has one of its own,
# COPY_ORIGIN_PREFIX + <hash of its queue and table> + "." + P, dropped when it is done.
ORIGIN_PREFIX = "pgcascade_"
COPY_ORIGIN_PREFIX = "pgcascade."


def peer_origin(peer: str) -> str:
    """The replication origin a worker's apply of `peer` runs under."""
    return ORIGIN_PREFIX + peer


def ensure_origin(conn: psycopg.Connection, name: str) -> None:
    conn.execute(
        "select pg_replication_origin_create(%s)"
        " where not exists (select 1 from pg_replication_origin where roname = %s)",
        (name, name),
    )


def use_origin(conn: psycopg.Connection, name: str) -> None:
    """This session's changes are the origin's peer's (for the rest of the session)."""
    conn.execute("select pg_replication_origin_session_setup(%s)", (name,))


def copy_origin(peer: str, queue: str, table: str) -> str:
    return f"{COPY_ORIGIN_PREFIX}{zlib.crc32(f'{queue} {table}'.encode()):08x}.{peer}"


def drop_origin(conn: psycopg.Connection, name: str) -> None:
    conn.execute(
        "select pg_replication_origin_drop(roname) from pg_replication_origin where roname = %s", (name,)
    )


def peer_of_origin(name: str) -> str | None:
    """The two-way peer a replication origin stands for, or None."""
    if name.startswith(ORIGIN_PREFIX):
        return name.removeprefix(ORIGIN_PREFIX)
    if name.startswith(COPY_ORIGIN_PREFIX):
        return name.removeprefix(COPY_ORIGIN_PREFIX).partition(".")[2] or None
    return None


def is_logical(conn: psycopg.Connection, queue: str) -> bool:
    if scalar(conn, "select to_regclass('pgcascade.walcapture') is null"):
        return False
    row = conn.execute("select 1 from pgcascade.walcapture where queue_name = %s", (queue,)).fetchone()
    return row is not None


@dataclass(frozen=True)
class SlotSetup:
    """The publication and slot of a root that starts capturing through a slot, and which of
    them this command created (so that a failure drops what it made, and nothing else)."""

    slot: str
    publication: str
    made_slot: bool
    made_publication: bool


def names_for(conn: psycopg.Connection, queue: str) -> tuple[str, str]:
    """(slot, publication) of a queue, known before its queue exists: a retry after a failure
    finds what the failed attempt made.  Slots are per cluster, so the slot's name carries the
    database.  (Roots made before this release keep the names stored in walcapture.)"""
    tag = hashlib.md5(queue.encode()).hexdigest()[:16]
    dboid = scalar(conn, "select oid from pg_database where datname = current_database()")
    return f"pgcascade_{dboid}_{tag}", f"pgcascade_{tag}"


def slot_exists(conn: psycopg.Connection, slot: str) -> bool:
    return (
        conn.execute("select 1 from pg_replication_slots where slot_name = %s", (slot,)).fetchone()
        is not None
    )


def prepare_slot(conn: psycopg.Connection, queue: str) -> SlotSetup:
    """The publication, then the slot, each committed on its own (a slot cannot be made in a
    transaction that has written): the caller records them in its transaction, and calls
    `undo` if that fails.  A failed slot takes the publication made for it along."""
    if scalar(conn, "select current_setting('wal_level')") != "logical":
        raise UserError("logical capture needs wal_level = logical on the root (a server restart)")
    slot, pub = names_for(conn, queue)
    made_pub = False
    if not conn.execute("select 1 from pg_publication where pubname = %s", (pub,)).fetchone():
        # via_partition_root: a partitioned table's changes carry its own name, as with triggers
        conn.execute(
            sql.SQL("create publication {} with (publish_via_partition_root = true)").format(
                sql.Identifier(pub)
            )
        )
        made_pub = True
    setup = SlotSetup(slot, pub, False, made_pub)
    if slot_exists(conn, slot):
        return setup
    try:
        create_slot(conn, slot)
    except RuntimeFailure:
        undo(conn, setup)
        raise
    return SlotSetup(slot, pub, True, made_pub)


def create_slot(conn: psycopg.Connection, slot: str) -> None:
    """After the publication is committed: decoding looks it up as of each change it decodes."""
    try:
        conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    except psycopg.errors.InsufficientPrivilege as e:
        raise RuntimeFailure(
            f"cannot create replication slot {slot}: {db_error_line(e)} (logical capture needs a role"
            " with REPLICATION: ALTER ROLE ... REPLICATION)"
        ) from None
    except psycopg.Error as e:
        raise RuntimeFailure(f"cannot create replication slot {slot}: {db_error_line(e)}") from None


def register(conn: psycopg.Connection, queue: str, setup: SlotSetup) -> None:
    """In the caller's transaction: the root `queue` captures through this slot."""
    conn.execute(
        "insert into pgcascade.walcapture (queue_name, slot_name, publication) values (%s, %s, %s)",
        (queue, setup.slot, setup.publication),
    )


def undo(conn: psycopg.Connection, setup: SlotSetup) -> None:
    """Drop what prepare_slot made (best effort: the command is failing already)."""
    with contextlib.suppress(psycopg.Error):
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()
        if setup.made_slot:
            conn.execute("select pg_drop_replication_slot(%s)", (setup.slot,))
        if setup.made_publication:
            conn.execute(sql.SQL("drop publication if exists {}").format(sql.Identifier(setup.publication)))


def drop_leftovers(conn: psycopg.Connection, queue: str) -> None:
    """A trigger root: the slot and publication of a logical create-root that died before it
    recorded them (no walcapture row names them) would hold WAL for ever: dropped."""
    slot, pub = names_for(conn, queue)
    if is_logical(conn, queue):
        return
    if slot_exists(conn, slot):
        log.info("dropping replication slot %s left by a logical create-root that failed", slot)
        conn.execute("select pg_drop_replication_slot(%s)", (slot,))
    conn.execute(sql.SQL("drop publication if exists {}").format(sql.Identifier(pub)))


def setup_logical(conn: psycopg.Connection, queue: str) -> bool:
    """Make the existing root `queue` capture through a slot; True if anything was created.
    Repeatable: a slot lost (dropped by hand) is created again, from now on.  (capture.tables.
    use_logical first refuses a trigger root that has tables.)"""
    if is_logical(conn, queue):
        slot = scalar(conn, "select slot_name from pgcascade.walcapture where queue_name = %s", (queue,))
        if slot_exists(conn, slot):
            return False
        mark_lost(conn, queue)  # a slot lost: what it missed stays to be repaired (recover-slot)
        create_slot(conn, slot)
        return True
    setup = prepare_slot(conn, queue)
    try:
        with conn.transaction():
            register(conn, queue, setup)
    except BaseException:
        undo(conn, setup)
        raise
    return True


def add_table(conn: psycopg.Connection, queue: str, table: str, keys: list[str]) -> str:
    """Publish the table; returns the replica identity it needs ('default' or 'full')."""
    ident = scalar(conn, "select pgcascade.walcapture_add_table(%s, %s::regclass, %s)", (queue, table, keys))
    if ident == "full":
        log.warning(
            "%s: REPLICA IDENTITY FULL (its key is not the primary key, or an UPDATE may leave a"
            " TOASTed value out): its updates and deletes log the whole old row",
            table,
        )
    return ident


def remove_table(conn: psycopg.Connection, queue: str, table: str) -> None:
    conn.execute("select pgcascade.walcapture_remove_table(%s, %s::regclass)", (queue, table))


def capture_status(conn: psycopg.Connection, queue: str) -> tuple | None:
    """For `status`: (slot, exists, active, retained bytes, bytes not captured yet, wal_status,
    since the last captured commit, since the daemon last wrote, last error, its time); None
    for a root that captures with triggers."""
    if not is_logical(conn, queue):
        return None
    return conn.execute(
        "select slot_name, slot_exists, slot_active, retained_bytes, behind_bytes, wal_status,"
        " now() - last_commit, now() - last_capture, last_error, last_error_time"
        " from pgcascade.walcapture_status(%s)",
        (queue,),
    ).fetchone()


def wait_captured(conn: psycopg.Connection, queue: str, timeout: float) -> None:
    """Wait until everything committed on the root before this call is in the queue."""
    # the insert position: an asynchronous commit may not be written yet, and its record
    # lies beyond the write position (pg_current_wal_lsn) until the WAL writer gets to it
    target = scalar(conn, "select pg_current_wal_insert_lsn()")
    deadline = time.monotonic() + timeout
    while True:
        done = conn.execute(
            "select greatest(w.confirmed_lsn, s.confirmed_flush_lsn) >= %s::pg_lsn"
            " from pgcascade.walcapture w left join pg_replication_slots s on s.slot_name = w.slot_name"
            " where w.queue_name = %s",
            (target, queue),
        ).fetchone()
        if done is None or done[0]:
            return
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"the capture daemon of {queue} has not read the WAL up to {target}")
        time.sleep(0.05)


def refuse_without_logical_root(conn: psycopg.Connection, queue: str) -> None:
    node = nodes.require_node(conn, queue)
    if not node.role.is_root or not is_logical(conn, queue):
        raise UserError(
            f"node {node.node_name} ({node.node_type}) has no logical capture: it is set at create-root --capture=logical"
        )


RECOVER_HINT = "run recover-slot (docs/operations.md, 'A lost capture slot')"


def slot_problem(conn: psycopg.Connection, queue: str) -> str | None:
    """What is wrong with the root's slot, for `status` and `status --check`: missing, lost
    (invalidated: it held more WAL than max_slot_wal_keep_size), about to be lost, or replaced
    with the repair of what was lost not finished; None when nothing is (or no slot is used)."""
    if not is_logical(conn, queue):
        return None
    slot, exists, wal_status, confirmed = one(
        conn,
        "select w.slot_name, s.slot_name is not null, s.wal_status, w.confirmed_lsn::text"
        " from pgcascade.walcapture w left join pg_replication_slots s on s.slot_name = w.slot_name"
        " where w.queue_name = %s",
        (queue,),
    )
    if not exists:
        return f"slot {slot} is missing: changes after {confirmed} are not in the queue; {RECOVER_HINT}"
    if wal_status == "lost":
        return (
            f"slot {slot} was invalidated (it held more WAL than max_slot_wal_keep_size): changes after"
            f" {confirmed} are not in the queue; {RECOVER_HINT}"
        )
    if wal_status == "unreserved":
        return (
            f"slot {slot} holds more WAL than max_slot_wal_keep_size and will be invalidated at the next"
            " checkpoint: is the capture daemon running?"
        )
    recovery = recovery_from(conn, queue)
    if recovery is not None:
        return f"slot {slot} is new; the changes lost after {recovery} are not repaired yet: {RECOVER_HINT}"
    return None


def recovery_from(conn: psycopg.Connection, queue: str) -> str | None:
    """Where the changes lost with the last slot begin, while their repair is not done."""
    try:
        return scalar(
            conn, "select recovery_from::text from pgcascade.walcapture where queue_name = %s", (queue,)
        )
    except psycopg.errors.UndefinedColumn:  # a root not upgraded yet (migration 14)
        return None


def renew_slot(conn: psycopg.Connection, queue: str) -> bool:
    """Replace a lost or missing slot by a new one that captures from now on; True if it did.
    Where the loss began is recorded first (recovery_from, kept until `recovery_done`), so a
    run that dies anywhere is resumed by running it again.  Needs REPLICATION, as create-root."""
    slot, exists, wal_status = one(
        conn,
        "select w.slot_name, s.slot_name is not null, s.wal_status from pgcascade.walcapture w"
        " left join pg_replication_slots s on s.slot_name = w.slot_name where w.queue_name = %s",
        (queue,),
    )
    if exists and wal_status != "lost":
        return False
    mark_lost(conn, queue)
    if exists:
        try:
            conn.execute("select pg_drop_replication_slot(%s)", (slot,))
        except psycopg.Error as e:
            raise RuntimeFailure(
                f"cannot drop the lost replication slot {slot}: {db_error_line(e)}"
            ) from None
    create_slot(conn, slot)
    lsn = scalar(
        conn, "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,)
    )
    conn.execute(
        "update pgcascade.walcapture set confirmed_lsn = %s::pg_lsn, last_error = null, last_error_time = null"
        " where queue_name = %s",
        (lsn, queue),
    )
    log.warning(
        "slot %s made anew at %s: changes after %s were not captured", slot, lsn, recovery_from(conn, queue)
    )
    return True


def mark_lost(conn: psycopg.Connection, queue: str) -> None:
    """Remember where the changes the queue never got begin, until recover-slot repaired them."""
    with contextlib.suppress(psycopg.errors.UndefinedColumn):  # a root not upgraded yet (migration 14)
        conn.execute(
            "update pgcascade.walcapture set recovery_from = coalesce(recovery_from, confirmed_lsn)"
            " where queue_name = %s",
            (queue,),
        )


def recovery_done(conn: psycopg.Connection, queue: str) -> None:
    conn.execute("update pgcascade.walcapture set recovery_from = null where queue_name = %s", (queue,))
