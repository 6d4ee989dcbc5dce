"""The daemons: ticker, worker (Londiste 2: replay), capture, and the copy process the worker
starts.  Each runs in the foreground, or with -d in the background; -s, -k and -r signal the
running one through its pidfile.

Each verb imports its daemon's modules when it runs: the worker starts a copy process per table
and tests and scripts start tickers often, so none of them loads the others' (or -s/-k/-r any).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
import psycopg

from pgcascade.cli.context import Context, control_or_start, daemon_switches, pass_ctx
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon, setup_logging

if TYPE_CHECKING:
    from pgcascade.replica.worker import Worker


@click.command()
@click.argument("config", required=False)
@daemon_switches
@click.pass_context
def ticker(cctx: click.Context, config: str | None, detach: bool, ctl: str | None) -> None:
    """Run the ticker daemon: ticks and maintenance for every configured database."""
    ctx: Context = cctx.obj
    if config:
        ctx.config_path = config
    control_or_start(ctx, make_ticker, detach, ctl)


def make_ticker(cfg: JobConfig) -> Daemon:
    from pgcascade.pgq.ticker import Ticker

    return Ticker(cfg)


def refuse_without_node(ctx: Context) -> None:
    """A database that is no node has no worker, and apply_delay is a leaf's: say so and exit 2
    instead of starting a daemon that retries forever.  An unreachable database is left to the
    daemon.  A root's worker waits, for the day a takeover makes the root a branch."""
    from pgcascade.replica.delay import refuse_apply_delay

    try:
        conn = ctx.connect()
    except psycopg.OperationalError:
        return
    with conn:
        refuse_apply_delay(ctx.cfg, ctx.node(conn))


@click.command()
@daemon_switches
@pass_ctx
def worker(ctx: Context, detach: bool, ctl: str | None) -> None:
    """Run the replay worker of this node (-d detach, -s stop, -k kill, -r reload)."""
    if not ctl:
        refuse_without_node(ctx)
    control_or_start(ctx, worker_with_table_metrics, detach, ctl)


def worker_with_table_metrics(cfg: JobConfig) -> Worker:
    """The worker; with metrics_port, its /metrics also reads the node's per-table lag and
    copy progress from the database at each scrape (monitor/exporter.py)."""
    from prometheus_client import REGISTRY

    from pgcascade.monitor.exporter import NodeCollector
    from pgcascade.pipeline.copy import SparkCopier
    from pgcascade.replica.worker import Worker

    if cfg.metrics_port is not None and cfg.db and cfg.queue_name:
        REGISTRY.register(NodeCollector(cfg.db, cfg.queue_name))
    return Worker(cfg, bulk=SparkCopier())


@click.command("capture")
@daemon_switches
@pass_ctx
def capture(ctx: Context, detach: bool, ctl: str | None) -> None:
    """Run the root's logical capture daemon: the slot into the queue (-d, -s, -k, -r)."""
    from pgcascade.capture import logical
    from pgcascade.capture.daemon import WalCapture

    if not ctl:
        try:
            conn = ctx.connect()
        except psycopg.OperationalError:
            conn = None  # unreachable: the daemon retries
        if conn is not None:
            with conn:
                logical.refuse_without_logical_root(conn, ctx.queue())
    control_or_start(ctx, WalCapture, detach, ctl)


@click.command(hidden=True)
@click.argument("table")
@click.option("--queue", help="the queue the table comes from (a two-way master's peer queue)")
@pass_ctx
def copy(ctx: Context, table: str, queue: str | None) -> None:
    """Internal: the copy process of one table (the worker starts it)."""
    from pgcascade.pipeline.copy import SparkCopier
    from pgcascade.replica.copy import CopyProcess

    setup_logging(ctx.cfg.logfile, verbose=ctx.verbose, quiet=ctx.quiet)
    cfg = ctx.cfg.with_changes(queue_name=queue) if queue else ctx.cfg
    CopyProcess(cfg, table, bulk=SparkCopier()).start()


COMMANDS = [ticker, worker, capture, copy]
