"""`recover-slot`: a root whose logical capture slot was lost captures again, and every node of
the set gets the changes that never reached the queue - without copying a table again.

A slot is lost when it held more WAL than `max_slot_wal_keep_size` (PostgreSQL invalidates it
at a checkpoint) or when it was dropped.  The changes committed from the queue's last captured
position (walcapture.confirmed_lsn) until a new slot exists are then in no queue, and every
node of the set missed the same ones, since they all replay that queue.  So:

1. A new slot (capture.logical.renew_slot), capturing from now on.  Where the loss began is
   recorded first (`recovery_from`) and kept until step 3 is done: `status` says the recovery
   is unfinished, and running the command again resumes it.
2. Wait until the capture daemon reads the new slot (it polls a lost slot every few seconds).
3. Compare the root with the subscribers directly below it - each table with one of them that
   holds it in state ok - under a sync point, as `compare` does (checksums of key ranges; only
   differing rows are read).  The root's rows of the keys that differ go into its queue as
   repair events (pipeline/repair.py, `emit_fix`), which every node applies in order with the
   other changes, the compared one and every node below or beside it alike.

What the loss took that is not rows - a table list change (add-table, remove-table on the root)
or an `execute` made while the slot was lost - is not recovered: the command cannot see it;
docs/operations.md says what to check.  Two-way peers are not compared (their own writes are
not a loss); each is repaired with `repair` on its side.
"""

from __future__ import annotations

import logging
import sys

import psycopg

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade import survey
from pgcascade.cascade.waits import wait_applied
from pgcascade.core import pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.errors import RuntimeFailure, UserError
from pgcascade.pgq import node as nodes
from pgcascade.pipeline.compare import Comparison, Progress
from pgcascade.pipeline.repair import CASCADE_WAIT, KeySpool, emit_fix, write_report
from pgcascade.replica import tables as subscriber

log = logging.getLogger("pgcascade.pipeline")

CAPTURE_WAIT = 60.0  # seconds to wait for the capture daemon to read the new slot


def recover_slot(cfg: JobConfig, spark_for, progress: bool = True) -> int:
    """The command (see the module doc); `spark_for(prog)` makes the Spark session when a
    compare needs one.  Returns the exit code: 0 when the set is whole again."""
    prog = Progress(progress)
    queue = cfg.queue_name or ""
    with pgconn.connect(cfg.db or "", autocommit=True, connect_timeout=10) as root:
        logical.refuse_without_logical_root(root, queue)
        if logical.renew_slot(root, queue):
            prog.step("slot made anew: capturing from now on")
        lost_from = logical.recovery_from(root, queue)
        if lost_from is None:
            print(f"the capture slot of {queue} is fine: nothing to recover")
            return 0
        prog.step(
            f"changes after {lost_from} were not captured; waiting for the capture daemon to read the new slot"
        )
        try:
            logical.wait_captured(root, queue, CAPTURE_WAIT)
        except RuntimeFailure:
            raise RuntimeFailure(
                f"the capture daemon of {queue} does not read the new slot: start it (pgcascade CONFIG capture -d)"
                " and run recover-slot again"
            ) from None
        plan = compare_plan(root, queue)
    spark = spark_for(prog) if plan else None
    fixed = 0
    for member, tables in plan:
        prog.step(f"comparing {len(tables)} table(s) with {member.name}")
        fixed += repair_through(
            cfg.db or "", cfg.with_changes(db=member.location), member, tables, spark, prog
        )
    with pgconn.connect(cfg.db or "", autocommit=True, connect_timeout=10) as root:
        logical.recovery_done(root, queue)
    print(f"recovered: {fixed} key(s) repaired on every node through the queue")
    return 0


def compare_plan(root: psycopg.Connection, queue: str) -> list[tuple[survey.Member, list[str]]]:
    """Each table of the set with one subscriber directly below the root that holds all of it
    (state ok, no row filter or column list; the first by name); a table none holds is only
    reported.  Two-way peers and merge-leaves hold rows of their own: not compared."""
    me = nodes.require_node(root, queue)
    left = set(set_tables.set_tables(root, queue))
    plan = []
    below = [
        m
        for m in survey.survey(root, queue)
        if m.node is not None
        and m.node.provider_node == me.node_name
        and not (m.node.is_peer or m.node.combined_queue or m.dead)
    ]
    for m in sorted(below, key=lambda m: m.name):
        with survey.connect(m.location) as conn:
            ok = [
                t.table_name
                for t in subscriber.tables(conn, queue)
                if t.state.is_ok and t.table_name in left and t.row_filter is None and t.column_list is None
            ]
        if ok:
            plan.append((m, sorted(ok)))
            left -= set(ok)
    for t in sorted(left):
        log.warning("%s: no subscriber directly below the root holds it in state ok: not checked", t)
    return plan


def repair_through(
    root_dsn: str, cfg: JobConfig, member: survey.Member, tables: list[str], spark, prog: Progress
) -> int:
    """Compare `member` (cfg: its database) with the root; the differing keys go down the
    cascade as repair events; wait until `member` applied them.  Returns the keys repaired."""
    spool = KeySpool()
    try:
        with Comparison(cfg, tables, prog) as cmp:
            results = cmp.run(spark, spool.write)
            specs = cmp.task.specs
    except UserError as e:
        raise RuntimeFailure(f"{member.name}: {e}") from None
    write_report(results, sys.stdout)
    if spool.count == 0:
        return 0
    prog.step(f"sending the root's rows of {spool.count} key(s) down the cascade")
    queue = cfg.queue_name or ""
    tick = emit_fix(root_dsn, queue, specs, spool, cfg.pipeline.sync_timeout)
    with survey.connect(member.location) as conn:
        wait_applied(conn, queue, tick, f"{member.name} to apply the repair", log.info, CASCADE_WAIT)
    return spool.count
