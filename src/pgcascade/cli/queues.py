"""PgQ's administration: queues and consumers directly; and `status`, `config`."""

from __future__ import annotations

import sys

import click
import psycopg

from pgcascade.cli.context import Context, Duration, echo_json, pass_ctx
from pgcascade.core.config import known_keys
from pgcascade.core.daemon import setup_logging
from pgcascade.core.errors import UserError, redact
from pgcascade.monitor import report
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q


@click.group("queue")
def queue_group() -> None:
    """Manage queues and consumers directly (PgQ's administration)."""


@queue_group.command("create")
@click.argument("name")
@pass_ctx
def queue_create(ctx: Context, name: str) -> None:
    """Create queue NAME."""
    with ctx.connect() as conn:
        created = q.create_queue(conn, name)
    click.echo(f"queue {name}: {'created' if created else 'exists already'}")


@queue_group.command("drop")
@click.argument("name")
@click.option("--force", is_flag=True, help="Drop even with consumers registered.")
@pass_ctx
def queue_drop(ctx: Context, name: str, force: bool) -> None:
    """Drop queue NAME and its events."""
    with ctx.connect() as conn:
        q.drop_queue(conn, name, force)
    click.echo(f"queue {name}: dropped")


@queue_group.command("config")
@click.argument("name")
@click.argument("settings", nargs=-1, required=True)
@pass_ctx
def queue_config(ctx: Context, name: str, settings: tuple[str, ...]) -> None:
    """Set queue parameters: KEY=VALUE (ticker_max_count, ticker_max_lag, rotation_period, ...)."""
    pairs = []
    for s in settings:
        if "=" not in s:
            raise UserError(f"expected KEY=VALUE, got {s!r}")
        key, value = s.split("=", 1)
        pairs.append((key.strip(), value.strip()))
    with ctx.connect(autocommit=False) as conn:
        for key, value in pairs:
            q.set_queue_config(conn, name, key, value)
    click.echo(f"queue {name}: " + ", ".join(f"{k}={v}" for k, v in pairs))


@queue_group.command("register")
@click.argument("name")
@click.argument("consumer")
@pass_ctx
def queue_register(ctx: Context, name: str, consumer: str) -> None:
    """Register CONSUMER on queue NAME."""
    with ctx.connect() as conn:
        new = q.register_consumer(conn, name, consumer)
    click.echo(f"consumer {consumer} on {name}: {'registered' if new else 'was registered already'}")


@queue_group.command("unregister")
@click.argument("name")
@click.argument("consumer")
@pass_ctx
def queue_unregister(ctx: Context, name: str, consumer: str) -> None:
    """Unregister CONSUMER from queue NAME."""
    with ctx.connect() as conn:
        q.unregister_consumer(conn, name, consumer)
    click.echo(f"consumer {consumer} on {name}: unregistered")


@queue_group.command("tick")
@click.argument("name")
@pass_ctx
def queue_tick(ctx: Context, name: str) -> None:
    """Make a tick on queue NAME now."""
    with ctx.connect() as conn:
        tick = q.ticker(conn, name)
    click.echo(f"queue {name}: tick {tick}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="The node's state as JSON (docs/monitoring.md).")
@click.option("--check", is_flag=True, help="One line and exit 0 (ok) or 2 (critical), for monitoring.")
@click.option("--max-lag", type=Duration(), help="With --check: critical above this lag (30s, 5min).")
@pass_ctx
def status(ctx: Context, as_json: bool, check: bool, max_lag: float | None) -> None:
    """Show this node (type, provider, lag, tables per state, last error), or the queues."""
    if max_lag is not None and not check:
        raise UserError("--max-lag goes with --check")
    with ctx.connect() as conn:
        node = nodes.get_node(conn, ctx.cfg.queue_name) if ctx.cfg.queue_name else None
        if node is None:
            if as_json or check:
                raise UserError("this database is not a node of a set: --json and --check report on a node")
            print_status(conn)
        elif check:
            verdict = report.check(report.node_report(conn, node), max_lag)
            click.echo(verdict.line)
            sys.exit(verdict.code)
        elif as_json:
            echo_json(report.node_report(conn, node))
        else:
            print_status(conn, node)


def print_status(conn: psycopg.Connection, node: nodes.Node | None = None) -> None:
    """The tables a person reads; rich is loaded for them only (--check and --json, which
    scripts run often, start without it)."""
    from pgcascade.monitor import status as monitor

    if node is None:
        monitor.print_queue_status(conn)
    else:
        monitor.print_node_status(conn, node)


@click.command("config")
@click.pass_context
def config(cctx: click.Context) -> None:
    """List every config key: its value in CONFIG (when given), default and meaning."""
    ctx: Context = cctx.obj
    cfg = ctx.cfg if ctx.config_path else None
    for k in known_keys():
        default = "-" if k.default in (None, "", ()) else k.default
        line = f"{k.name:<22} {k.type:<16} default {default}"
        if cfg is not None:
            line += f"  = {config_value(cfg, k.group, k.name)}"
        click.echo(f"{line}\n    [{k.group}] {k.help}")
    for key, value in cfg.unknown.items() if cfg else ():
        click.echo(f"{key:<22} unknown to this release: ignored (= {value})")
    for key, value in cfg.spark_conf.items() if cfg else ():
        click.echo(f"{key:<22} passed to Spark as given (= {value})")


def config_value(cfg: object, group: str, name: str) -> object:
    """The key's value in the loaded config; passwords in connection strings hidden."""
    holder = cfg if group == "job" else getattr(cfg, group)
    value = getattr(holder, name)
    if value is None:
        return "-"
    return redact(value) if isinstance(value, str) else value


@click.command("serve")
@click.option("--port", type=click.IntRange(1, 65535), help="Port of the page (default: serve_port, 8432).")
@click.option("--address", help="Address to listen on (default: serve_address, 127.0.0.1).")
@pass_ctx
def serve(ctx: Context, port: int | None, address: str | None) -> None:
    """Serve the set's live page, /api/topology and /metrics until interrupted."""
    from pgcascade.monitor import web  # starlette and uvicorn: only for this verb

    with ctx.connect() as conn:
        ctx.node(conn)  # a node of a set, or one line saying it is not
    setup_logging(ctx.cfg.logfile, verbose=ctx.verbose, quiet=ctx.quiet)
    settings = ctx.cfg.serve
    web.serve(
        ctx.db(),
        ctx.queue(),
        address or settings.serve_address,
        port or settings.serve_port,
        settings.serve_refresh,
    )


COMMANDS = [queue_group, status, config, serve]
