"""The `compare` and `repair` verbs (cli/pipeline.py only parses their options and calls these).

Exit codes: 0 the tables are equal (or the repair left them equal), 3 differences found,
2 usage or config error, 1 failure (the sync point gave up, a database failed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys

import psycopg

from pgcascade.core import pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.errors import UserError
from pgcascade.pgq import node as nodes
from pgcascade.pipeline import recovery, sink
from pgcascade.pipeline.compare import Comparison, Progress, TableResult
from pgcascade.pipeline.repair import KeySpool, SqlWriter, apply_fix, open_output, report_rows, write_report

log = logging.getLogger("pgcascade.pipeline")

EXIT_EQUAL = 0
EXIT_DIFFERENT = 3


def compare(
    cfg: JobConfig, tables: list[str], count_only: bool = False, progress: bool = True, as_json: bool = False
) -> int:
    prog = Progress(progress)
    # Spark first: a config mistake fails before the provider is locked, and the snapshots are
    # not held open while Spark starts
    cmp = Comparison(cfg, tables, prog)  # checks the tables: a typo fails at once
    spark = None if count_only else _spark(cfg, prog, "pgcascade compare")
    with cmp:
        results = cmp.count_only() if count_only else cmp.run(spark)
    if as_json:
        json.dump(report_rows(results, count_only), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        write_report(results, sys.stdout, count_only)
    equal = all(r.rows == r.sub_rows for r in results) if count_only else all(r.equal for r in results)
    return EXIT_EQUAL if equal else EXIT_DIFFERENT


def repair(cfg: JobConfig, tables: list[str], output: str | None, apply: bool, progress: bool = True) -> int:
    """Compare, write the fix (--output) and/or apply it (--apply).  Exit 0 when nothing differed
    or the fix was applied, 3 when differences were only written out."""
    prog = Progress(progress)

    cmp = Comparison(cfg, tables, prog)
    spark = _spark(cfg, prog, "pgcascade repair")
    with contextlib.ExitStack() as stack:
        stack.enter_context(cmp)
        spool = KeySpool() if apply else None
        writer = None
        if output:
            out = open_output(output)
            if out is not sys.stdout:
                stack.enter_context(out)
            conn = stack.enter_context(pgconn.connect(cmp.sync.sub_dsn, autocommit=True))
            writer = SqlWriter(out, conn, cmp.task.specs, branch=is_branch(conn, cmp.queue))

        def on_row(result: TableResult, row: dict) -> None:
            if writer is not None:
                writer.write(result, row)
            if spool is not None:
                spool.write(result, row)

        results = cmp.run(spark, on_row)
        if writer is not None:
            writer.close()
        specs = cmp.task.specs
    write_report(results, sys.stderr if output == "-" else sys.stdout)
    differing = sum(r.missing + r.extra + r.different for r in results)
    if spool is not None and spool.count:
        # the spool's count: the keys the fix replaces, whatever the report's figures say
        prog.step(f"applying the fix of {spool.count} differing row(s) under a new sync point")
        with pgconn.connect(cmp.db, autocommit=True) as conn:
            branch = is_branch(conn, cmp.queue)
        if branch:
            prog.step("sending the fix through the root's queue (a branch: the nodes below need it too)")
        n = apply_fix(cmp.db, cmp.queue, specs, spool, cmp.settings.sync_timeout)
        if branch:
            prog.step(f"applied: {n} key(s) fixed here with the root's rows, and on their way below")
        else:
            prog.step(f"applied: {n} row(s) replaced by the provider's")
        return EXIT_EQUAL
    return EXIT_EQUAL if differing == 0 else EXIT_DIFFERENT


def recover_slot(cfg: JobConfig, progress: bool = True) -> int:
    """`recover-slot` on a root with logical capture (pipeline/recovery.py)."""
    return recovery.recover_slot(cfg, lambda prog: _spark(cfg, prog, "pgcascade recover-slot"), progress)


def is_branch(conn: psycopg.Connection, queue: str) -> bool:
    return nodes.require_node(conn, queue).role.copies_events


def _spark(cfg: JobConfig, prog: Progress, app_name: str):
    from pgcascade.pipeline.session import build_session

    where = cfg.pipeline.spark_remote.split(";")[0] or cfg.pipeline.spark_master  # no token
    prog.step(f"starting Spark ({where})")
    spark = build_session(cfg, app_name)
    prog.step("Spark ready")
    return spark


def compact(cfg: JobConfig) -> None:
    """`sink compact`: each table's current state as Parquet under DIR/_current."""
    path = cfg.pipeline.sink_path
    if not path:
        raise UserError("sink compact needs --path DIR (or sink_path in the config)")
    prog = Progress(True)
    rows = sink.compact(_spark(cfg, prog, "pgcascade sink compact"), path)
    for table, n in rows.items():
        print(f"{table}: {n} rows in {path.rstrip('/')}/_current/{table}")
