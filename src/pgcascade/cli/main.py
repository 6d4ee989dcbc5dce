"""`pgcascade`: one command, Londiste-style verbs.

    pgcascade CONFIG.ini VERB [ARGS]       a verb on the job that CONFIG.ini describes
    pgcascade ticker CONFIG.ini [-d|-s|-k|-r]
    pgcascade CONFIG.ini capture [-d|-s|-k|-r]   the root's logical capture daemon
    pgcascade demo

The config comes first, as in Londiste; main() moves it behind `--config` for click.
Every failure ends in one line on stderr and the exit code of DESIGN.md: 0 ok, 1 runtime
failure, 2 usage or config error.  Tracebacks are for bugs only (and go to the log with -v).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import click
import psycopg

from pgcascade.capture import logical as walcapture
from pgcascade.capture import tables as capture
from pgcascade.core import pgconn, schema
from pgcascade.core.config import JobConfig, load_config
from pgcascade.core.daemon import setup_logging, signal_daemon
from pgcascade.core.errors import ConfigError, RuntimeFailure, UserError, db_error_line, redact
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import tables as subscriber

log = logging.getLogger("pgcascade")

# SQLSTATEs our SQL functions raise for bad input: unknown object, invalid parameter, wrong state.
USER_SQLSTATES = {"P0002", "22023", "22004", "55000", "55006"}
# SQLSTATE classes that are the user's input too: 22 = data exception (a value that is not an
# interval, an integer out of range, ... as in `queue config q ticker_max_lag=soon`).
USER_SQLSTATE_CLASSES = {"22"}


def is_user_sqlstate(sqlstate: str | None) -> bool:
    return sqlstate is not None and (sqlstate in USER_SQLSTATES or sqlstate[:2] in USER_SQLSTATE_CLASSES)


class Context:
    def __init__(self, config_path: str | None, verbose: bool = False, quiet: bool = False):
        self.config_path = config_path
        self.verbose = verbose
        self.quiet = quiet
        self._cfg: JobConfig | None = None

    @property
    def cfg(self) -> JobConfig:
        if self._cfg is None:
            if not self.config_path:
                raise UserError("this verb needs a config file: pgcascade CONFIG.ini VERB")
            self._cfg = load_config(self.config_path)
        return self._cfg

    def db(self) -> str:
        if not self.cfg.db:
            raise UserError(f"{self.cfg.path}: db is not set")
        try:
            psycopg.conninfo.conninfo_to_dict(self.cfg.db)
        except psycopg.ProgrammingError as e:
            raise ConfigError(f"{self.cfg.path}: db: {db_error_line(e)}") from None
        return self.cfg.db

    def connect(self, autocommit: bool = True, connstr: str | None = None) -> psycopg.Connection:
        return pgconn.connect(connstr or self.db(), autocommit=autocommit, connect_timeout=10)

    def provider_db(self) -> str:
        """The seed's `provider_db` (Londiste 2 configs): where the provider_* commands act."""
        if not self.cfg.provider_db:
            raise UserError(f"{self.cfg.path}: provider_db is not set")
        try:
            psycopg.conninfo.conninfo_to_dict(self.cfg.provider_db)
        except psycopg.ProgrammingError as e:
            raise ConfigError(f"{self.cfg.path}: provider_db: {db_error_line(e)}") from None
        return self.cfg.provider_db

    def queue(self) -> str:
        if not self.cfg.queue_name:
            raise UserError(f"{self.cfg.path}: queue_name is not set")
        return self.cfg.queue_name

    def node(self, conn: psycopg.Connection) -> nodes.Node:
        return nodes.require_node(conn, self.queue())

    def provider(self, conn: psycopg.Connection, node: nodes.Node) -> psycopg.Connection:
        return self.connect(connstr=nodes.provider_location(conn, node))


pass_ctx = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", hidden=True)
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
@click.option("-q", "--quiet", is_flag=True, help="Log only to the logfile.")
@click.version_option(package_name="pgcascade")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, verbose: bool, quiet: bool) -> None:
    """pgcascade CONFIG.ini VERB [ARGS] - cascaded replication for PostgreSQL."""
    ctx.obj = Context(config_path, verbose, quiet)
    setup_logging(None, verbose=verbose, quiet=quiet)


def daemon_switches(f):
    """-d/-s/-k/-r as every Skytools daemon has them."""
    f = click.option(
        "-r", "--reload", "ctl", flag_value="reload", help="Make the running daemon reload its config."
    )(f)
    f = click.option("-k", "--kill", "ctl", flag_value="kill", help="Kill the running daemon.")(f)
    f = click.option(
        "-s", "--stop", "ctl", flag_value="stop", help="Stop the running daemon after its current work."
    )(f)
    f = click.option("-d", "--daemon", "detach", is_flag=True, help="Run in the background.")(f)
    return f


def control_or_start(ctx: Context, daemon_cls, detach: bool, ctl: str | None) -> None:
    cfg = ctx.cfg
    if ctl:
        sig = {"stop": signal.SIGINT, "kill": signal.SIGTERM, "reload": signal.SIGHUP}[ctl]
        pid = signal_daemon(cfg, sig)
        click.echo(f"{cfg.job_name} (pid {pid}): {ctl} sent")
        return
    setup_logging(cfg.logfile, verbose=ctx.verbose, quiet=ctx.quiet, to_stderr=not detach)
    daemon_cls(cfg).start(detach=detach)


# --- schema -----------------------------------------------------------------------------------


@cli.command()
@pass_ctx
def install(ctx: Context) -> None:
    """Install or upgrade pgcascade's schema in the job's database."""
    with ctx.connect() as conn:
        before, after = schema.install(conn)
    if before == after:
        click.echo(f"pgcascade schema is at version {after}; functions refreshed")
    else:
        click.echo(f"pgcascade schema upgraded from version {before} to {after}")


# --- ticker -----------------------------------------------------------------------------------


@cli.command()
@click.argument("config", required=False)
@daemon_switches
@click.pass_context
def ticker(cctx: click.Context, config: str | None, detach: bool, ctl: str | None) -> None:
    """Run the ticker daemon: ticks and maintenance for every configured database."""
    from pgcascade.pgq.ticker import Ticker

    ctx: Context = cctx.obj
    if config:
        ctx.config_path = config
    control_or_start(ctx, Ticker, detach, ctl)


# --- queues -----------------------------------------------------------------------------------


@cli.group("queue")
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
        pairs.append(s.split("=", 1))
    with ctx.connect(autocommit=False) as conn:
        for key, value in pairs:
            q.set_queue_config(conn, name, key.strip(), value.strip())
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


@cli.command()
@pass_ctx
def status(ctx: Context) -> None:
    """Show this node (type, provider, lag, tables per state, last error), or the queues."""
    from pgcascade.monitor.status import print_node_status, print_queue_status

    with ctx.connect() as conn:
        node = nodes.get_node(conn, ctx.cfg.queue_name) if ctx.cfg.queue_name else None
        if node is None:
            print_queue_status(conn)
        else:
            print_node_status(conn, node)


# --- nodes ------------------------------------------------------------------------------------


@cli.command("create-root")
@click.argument("node_name")
@click.argument("location", required=False)
@click.option(
    "--capture",
    "capture_mode",
    type=click.Choice(["trigger", "logical"]),
    help="How changes are captured: trigger (default) or logical (a slot read by the capture daemon).",
)
@pass_ctx
def create_root(ctx: Context, node_name: str, location: str | None, capture_mode: str | None) -> None:
    """Make this database the root of the set: install, create the queue."""
    with ctx.connect() as conn:
        created = nodes.create_root(conn, ctx.queue(), node_name, location or ctx.db())
        logical = walcapture.is_logical(conn, ctx.queue())
        if capture_mode == "logical":
            created = walcapture.setup_logical(conn, ctx.queue()) or created
            logical = True
        elif capture_mode == "trigger" and logical:
            raise UserError(f"root of {ctx.queue()} captures through a slot already (logical)")
    mode = "logical: run the capture daemon" if logical else "trigger"
    click.echo(
        f"root {node_name} of {ctx.queue()}: {'created' if created else 'exists already'} (capture {mode})"
    )


def create_subscriber(
    ctx: Context,
    node_type: str,
    node_name: str,
    location: str | None,
    provider: str,
    merge: str | None = None,
) -> None:
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        loc = location or ctx.db()
        created = nodes.create_subscriber(conn, ctx.queue(), node_name, node_type, loc, provider, merge)
        if created and not cascade.announce_at_root(conn, ctx.queue(), node_name, loc):
            click.echo("the root is unreachable: other nodes learn this node's location later", err=True)
    click.echo(f"{node_type} {node_name} of {ctx.queue()}: {'created' if created else 'exists already'}")


@cli.command("create-branch")
@click.argument("node_name")
@click.argument("location", required=False)
@click.option("--provider", "provider", required=True, help="Connection string of the provider node.")
@pass_ctx
def create_branch(ctx: Context, node_name: str, location: str | None, provider: str) -> None:
    """Make this database a branch: it replays and carries the provider's queue."""
    create_subscriber(ctx, "branch", node_name, location, provider)


@cli.command("create-leaf")
@click.argument("node_name")
@click.argument("location", required=False)
@click.option("--provider", "provider", required=True, help="Connection string of the provider node.")
@click.option(
    "--merge", help="A merge-leaf: also write the changes into this combined queue (a set rooted here)."
)
@pass_ctx
def create_leaf(ctx: Context, node_name: str, location: str | None, provider: str, merge: str | None) -> None:
    """Make this database a leaf of the set, fed by the provider."""
    create_subscriber(ctx, "leaf", node_name, location, provider, merge)


# --- the cascade ------------------------------------------------------------------------------


def say(line: str) -> None:
    click.echo(line, err=True)


@cli.command()
@pass_ctx
def members(ctx: Context) -> None:
    """List the set's nodes: name, type, provider, location (passwords hidden)."""
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        ctx.node(conn)
        for m in cascade.survey(conn, ctx.queue()):
            kind = m.node.node_type if m.node else ("dead" if m.dead else "unreachable")
            prov = (m.node.provider_node or "-") if m.node else "?"
            click.echo(f"{m.name}\t{kind}\t{prov}\t{redact(m.location)}")


@cli.command("change-provider")
@click.option("--provider", "provider", required=True, help="Name of the node to feed from.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for a provider behind us.")
@click.option("--no-wait", is_flag=True, help="Refuse instead of waiting for a provider that is behind.")
@pass_ctx
def change_provider(ctx: Context, provider: str, timeout: float, no_wait: bool) -> None:
    """Feed this node from another node of the set, with no gap and no duplicate."""
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        click.echo(cascade.change_provider(conn, ctx.queue(), provider, say, timeout, no_wait))


@cli.command()
@click.argument("old_node")
@click.option("--dead-root", is_flag=True, help="The root is lost: become the root (failover).")
@click.option("--dead-branch", is_flag=True, help="The branch is lost: take over its subscribers.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for each step.")
@pass_ctx
def takeover(ctx: Context, old_node: str, dead_root: bool, dead_branch: bool, timeout: float) -> None:
    """Take OLD_NODE's place: a live root becomes our branch (switchover); --dead-root and
    --dead-branch take over from a lost node."""
    from pgcascade.cascade import ops as cascade

    if dead_root and dead_branch:
        raise UserError("--dead-root and --dead-branch exclude each other")
    with ctx.connect() as conn:
        me = ctx.node(conn)
        if dead_root:
            click.echo(cascade.failover(conn, ctx.queue(), old_node, say, timeout))
            return
        if dead_branch:
            click.echo(cascade.take_subscribers(conn, ctx.queue(), old_node, True, say, timeout))
            return
        if me.provider_node == old_node and me.node_type == "branch":
            with cascade.reach(cascade.member_location(conn, ctx.queue(), old_node)) as oc:
                old = nodes.get_node(oc, ctx.queue()) if oc is not None else None
            if old is None:
                raise RuntimeFailure(f"{old_node} does not answer: use --dead-root or --dead-branch")
            if old.node_type == "root":
                click.echo(cascade.switchover(conn, ctx.queue(), old_node, say, timeout))
                return
        click.echo(cascade.take_subscribers(conn, ctx.queue(), old_node, False, say, timeout))


@cli.command()
@click.option(
    "--lost-events",
    type=click.Path(dir_okay=False),
    help="File for the events that never reached the set (default: JOB_NAME.lost-events.jsonl beside the config).",
)
@pass_ctx
def resurrect(ctx: Context, lost_events: str | None) -> None:
    """An old root that was taken over comes back: save what it alone had, make it a branch."""
    from pgcascade.cascade import ops as cascade

    path = Path(lost_events or ctx.cfg.path.parent / f"{ctx.cfg.job_name}.lost-events.jsonl")
    with ctx.connect() as conn:
        click.echo(cascade.resurrect(conn, ctx.queue(), ctx.db(), path, say))


@cli.command("drop-node")
@click.argument("node_name")
@pass_ctx
def drop_node(ctx: Context, node_name: str) -> None:
    """Remove a node from the set (its registrations go, rotation is released)."""
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        ctx.node(conn)
        click.echo(cascade.drop_node(conn, ctx.queue(), node_name))


@cli.command()
@click.argument("node_name", required=False)
@pass_ctx
def pause(ctx: Context, node_name: str | None) -> None:
    """Pause a node's worker (this node by default)."""
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        click.echo(cascade.set_paused(conn, ctx.queue(), node_name or ctx.node(conn).node_name, True))


@cli.command()
@click.argument("node_name", required=False)
@pass_ctx
def resume(ctx: Context, node_name: str | None) -> None:
    """Resume a paused node's worker (this node by default)."""
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        click.echo(cascade.set_paused(conn, ctx.queue(), node_name or ctx.node(conn).node_name, False))


# --- tables and sequences ---------------------------------------------------------------------


@cli.command("add-table")
@click.argument("tables", nargs=-1)
@click.option(
    "--all", "all_tables", is_flag=True, help="Every table (root: of the database; leaf: of the set)."
)
@click.option("--key", help="Root: key columns of a table without a primary key (COL[,COL...]).")
@click.option(
    "--format",
    "event_format",
    default="json",
    show_default=True,
    help="Root: json or sql (the seed's partial SQL).",
)
@click.option("--expect-sync", is_flag=True, help="Subscriber: the table is in sync already; skip the copy.")
@click.option("--skip-truncate", is_flag=True, help="Subscriber: keep the rows already there when copying.")
@click.option("--force", is_flag=True, help="Subscriber: skip the structure check.")
@click.option("--create", is_flag=True, help="Subscriber: create the table from the provider's definition.")
@click.option("--dest-table", help="Subscriber: apply to this local table instead.")
@click.option(
    "--allow-local-writes", is_flag=True, help="Subscriber: do not refuse writes of ordinary sessions."
)
@click.option("--no-wait", is_flag=True, help="Subscriber: do not wait for tables just added on the root.")
@click.option("--timeout", default=600.0, show_default=True, help="Subscriber: seconds to wait for them.")
@pass_ctx
def add_table(
    ctx: Context,
    tables: tuple[str, ...],
    all_tables: bool,
    key: str | None,
    event_format: str,
    no_wait: bool,
    timeout: float,
    **opts,
) -> None:
    """Replicate tables: on the root, capture them; on a subscriber, subscribe to them."""
    if not tables and not all_tables:
        raise UserError("add-table needs table names (or --all)")
    with ctx.connect() as conn:
        node = ctx.node(conn)
        if node.role.captures_changes:
            keys = [k.strip() for k in key.split(",")] if key else None
            added = capture.add_tables(conn, ctx.queue(), list(tables), all_tables, keys, event_format)
        else:
            if key or event_format != "json":
                raise UserError("--key and --format are set on the root, where tables are captured")
            with ctx.provider(conn, node) as prov:
                if not no_wait and tables:
                    from pgcascade.cascade import ops as cascade

                    cascade.wait_provider_has_tables(conn, prov, ctx.queue(), list(tables), say, timeout)
                added = subscriber.add_tables(conn, prov, ctx.queue(), list(tables), all_tables, **opts)
            if node.combined_queue and added:
                from pgcascade.cascade import ops as cascade

                cascade.register_merged_tables(conn, node.combined_queue, ctx.queue(), added)
    for t in added:
        click.echo(f"added {t}")


@cli.command("remove-table")
@click.argument("tables", nargs=-1, required=True)
@pass_ctx
def remove_table(ctx: Context, tables: tuple[str, ...]) -> None:
    """Stop replicating tables (the tables and their rows stay)."""
    with ctx.connect() as conn:
        node = ctx.node(conn)
        if node.role.captures_changes:
            removed = capture.remove_tables(conn, ctx.queue(), list(tables))
        else:
            removed = subscriber.remove_tables(conn, ctx.queue(), list(tables))
    for t in removed:
        click.echo(f"removed {t}")


@cli.command("tables")
@pass_ctx
def tables_cmd(ctx: Context) -> None:
    """List the replicated tables (on a subscriber, with their state)."""
    with ctx.connect() as conn:
        node = ctx.node(conn)
        if node.role.captures_changes:
            for t, keys in capture.set_tables(conn, ctx.queue()).items():
                click.echo(f"{t}  key: {', '.join(keys)}")
        else:
            for t in subscriber.tables(conn, ctx.queue()):
                dest = f" -> {t.dest_table}" if t.dest_table != t.table_name else ""
                click.echo(f"{t.table_name}{dest}  {t.state or 'NULL'}")


@cli.command("missing")
@pass_ctx
def missing(ctx: Context) -> None:
    """List the provider's tables this subscriber does not replicate."""
    with ctx.connect() as conn:
        node = ctx.node(conn)
        if node.role.captures_changes:
            raise UserError("missing is a subscriber verb: the root has every table of the set")
        with ctx.provider(conn, node) as prov:
            for t in subscriber.missing_tables(conn, prov, ctx.queue()):
                click.echo(t)


@cli.command("resync")
@click.argument("tables", nargs=-1, required=True)
@pass_ctx
def resync(ctx: Context, tables: tuple[str, ...]) -> None:
    """Copy tables again (their state goes back to NULL)."""
    with ctx.connect() as conn:
        if ctx.node(conn).role.captures_changes:
            raise UserError("resync is a subscriber verb")
        for t in subscriber.resync_tables(conn, ctx.queue(), list(tables)):
            click.echo(f"resync {t}")


@cli.command("add-seq")
@click.argument("seqs", nargs=-1)
@click.option("--all", "all_seqs", is_flag=True, help="Every sequence.")
@pass_ctx
def add_seq(ctx: Context, seqs: tuple[str, ...], all_seqs: bool) -> None:
    """Replicate sequences: their values follow the root."""
    if not seqs and not all_seqs:
        raise UserError("add-seq needs sequence names (or --all)")
    with ctx.connect() as conn:
        node = ctx.node(conn)
        if node.role.captures_changes:
            added = capture.add_seqs(conn, ctx.queue(), list(seqs), all_seqs)
        else:
            with ctx.provider(conn, node) as prov:
                added = subscriber.add_seqs(conn, prov, ctx.queue(), list(seqs), all_seqs)
    for s in added:
        click.echo(f"added {s}")


@cli.command("remove-seq")
@click.argument("seqs", nargs=-1, required=True)
@pass_ctx
def remove_seq(ctx: Context, seqs: tuple[str, ...]) -> None:
    """Stop replicating sequences."""
    with ctx.connect() as conn:
        if ctx.node(conn).role.captures_changes:
            capture.remove_seqs(conn, ctx.queue(), list(seqs))
        else:
            subscriber.remove_seqs(conn, ctx.queue(), list(seqs))
    click.echo("removed " + ", ".join(seqs))


@cli.command("seqs")
@pass_ctx
def seqs_cmd(ctx: Context) -> None:
    """List the replicated sequences."""
    with ctx.connect() as conn:
        if ctx.node(conn).role.captures_changes:
            names = capture.set_seqs(conn, ctx.queue())
        else:
            names = [s for s, _ in subscriber.seqs(conn, ctx.queue())]
    for n in names:
        click.echo(n)


@cli.command("execute")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@pass_ctx
def execute(ctx: Context, files: tuple[str, ...]) -> None:
    """Run SQL scripts on the root and, at the same position of the stream, on every subscriber."""
    with ctx.connect() as conn:
        if not ctx.node(conn).role.captures_changes:
            raise UserError("execute runs on the root: its subscribers replay the script from the queue")
        for f in files:
            text = Path(f).read_text()
            with conn.transaction():
                conn.execute(text.encode())
                # the seed's partial-SQL capture names the columns: let it see the script's new ones
                conn.execute(
                    "select pgcascade.capture_enable(queue_name, table_name::regclass, key_columns, event_format)"
                    " from pgcascade.set_table where queue_name = %s and event_format = 'sql'"
                    " and to_regclass(table_name) is not null",
                    (ctx.queue(),),
                )
                # with logical capture, through the WAL: in order with the changes around it
                conn.execute(
                    "select pgcascade.emit_event(%s, 'EXECUTE', %s, %s)", (ctx.queue(), text, Path(f).name)
                )
            click.echo(f"executed {f}")


@cli.command("wait-sync")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait at most.")
@pass_ctx
def wait_sync(ctx: Context, timeout: float) -> None:
    """Wait until every table is ok and this node has applied everything committed before now."""
    from pgcascade.monitor.status import wait_sync as wait

    with ctx.connect() as conn:
        node = ctx.node(conn)
        with ctx.provider(conn, node) as prov:
            wait(conn, prov, node, timeout)
    click.echo("in sync")


@cli.command("wait-root")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait at most.")
@pass_ctx
def wait_root(ctx: Context, timeout: float) -> None:
    """Wait until this node applied everything committed on the root before now."""
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        tick = cascade.wait_root(conn, ctx.queue(), say, timeout)
    click.echo(f"applied the root's tick {tick}")


@cli.command("wait-provider")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait at most.")
@pass_ctx
def wait_provider(ctx: Context, timeout: float) -> None:
    """Wait until this node applied every tick its provider has now."""
    from pgcascade.cascade import ops as cascade

    with ctx.connect() as conn:
        tick = cascade.wait_provider(conn, ctx.queue(), say, timeout)
    click.echo(f"applied the provider's tick {tick}")


# --- the Spark pipeline (logic in pgcascade.pipeline) -----------------------------------------


@cli.command()
@click.argument("tables", nargs=-1)
@click.option("--count-only", is_flag=True, help="Compare row counts only (the seed's cheap check).")
@click.option("--no-progress", is_flag=True, help="No progress lines on stderr.")
@pass_ctx
def compare(ctx: Context, tables: tuple[str, ...], count_only: bool, no_progress: bool) -> None:
    """Compare TABLES (default: all) with the provider at a sync point; exit 3 when they differ."""
    from pgcascade.pipeline import commands

    ctx.db()
    sys.exit(commands.compare(ctx.cfg, list(tables), count_only, not no_progress))


@cli.command()
@click.argument("tables", nargs=-1)
@click.option("--output", "-o", help="Write the fixing SQL to this file ('-' for stdout).")
@click.option("--apply", "apply_fix", is_flag=True, help="Apply the fix in one transaction.")
@click.option("--no-progress", is_flag=True, help="No progress lines on stderr.")
@pass_ctx
def repair(
    ctx: Context, tables: tuple[str, ...], output: str | None, apply_fix: bool, no_progress: bool
) -> None:
    """Make TABLES (default: all) equal to the provider's: SQL to --output and/or --apply."""
    from pgcascade.pipeline import commands

    if not output and not apply_fix:
        raise UserError("repair needs --output FILE (write the fix) or --apply (apply it), or both")
    ctx.db()
    sys.exit(commands.repair(ctx.cfg, list(tables), output, apply_fix, not no_progress))


@cli.command("spark-server")
@click.argument("action", type=click.Choice(["start", "stop"]))
@pass_ctx
def spark_server(ctx: Context, action: str) -> None:
    """Start or stop a warm Spark (Spark Connect) that configs with spark_remote attach to."""
    from pgcascade.pipeline import connect

    if action == "start":
        click.echo(f"Spark Connect listening at {connect.start(ctx.cfg)}")
    else:
        connect.stop(ctx.cfg)
        click.echo("Spark Connect stopped")


@cli.command()
@click.argument("action", required=False, type=click.Choice(["compact"]))
@click.option("--path", "path", help="The lake directory (default: sink_path of the config).")
@daemon_switches
@pass_ctx
def sink(ctx: Context, action: str | None, path: str | None, detach: bool, ctl: str | None) -> None:
    """Write every batch's row changes as Parquet under --path; `sink compact`: current state."""
    from pgcascade.pipeline import commands

    if path:
        ctx.cfg.raw["sink_path"] = path
    if action == "compact":
        commands.compact(ctx.cfg)
        return
    from pgcascade.pipeline.sink import Sink

    control_or_start(ctx, Sink, detach, ctl)


# --- daemons ----------------------------------------------------------------------------------


def refuse_worker_without_node(ctx: Context) -> None:
    """A database that is no node has no worker: say so and exit 2 instead of starting a
    daemon that retries forever.  An unreachable database is left to the daemon.  A root's
    worker waits, for the day a takeover makes the root a branch."""
    try:
        conn = ctx.connect()
    except psycopg.OperationalError:
        return
    with conn:
        ctx.node(conn)


@cli.command()
@daemon_switches
@pass_ctx
def worker(ctx: Context, detach: bool, ctl: str | None) -> None:
    """Run the replay worker of this node (-d detach, -s stop, -k kill, -r reload)."""
    from pgcascade.replica.worker import Worker

    if not ctl:
        refuse_worker_without_node(ctx)
    control_or_start(ctx, Worker, detach, ctl)


@cli.command("capture")
@daemon_switches
@pass_ctx
def capture_daemon(ctx: Context, detach: bool, ctl: str | None) -> None:
    """Run the root's logical capture daemon: the slot into the queue (-d, -s, -k, -r)."""
    if not ctl:
        try:
            conn = ctx.connect()
        except psycopg.OperationalError:
            conn = None  # unreachable: the daemon retries
        if conn is not None:
            with conn:
                walcapture.refuse_without_logical_root(conn, ctx.queue())
    control_or_start(ctx, walcapture.WalCapture, detach, ctl)


@cli.command(hidden=True)
@click.argument("table")
@pass_ctx
def copy(ctx: Context, table: str) -> None:
    """Internal: the copy process of one table (the worker starts it)."""
    from pgcascade.replica.copy import CopyProcess

    setup_logging(ctx.cfg.logfile, verbose=ctx.verbose, quiet=ctx.quiet)
    CopyProcess(ctx.cfg, table).start()


@cli.command()
@click.option("--seconds", default=30.0, show_default=True, help="How long the workload runs.")
@click.option("--keep", is_flag=True, help="Leave the clusters running and print how to reach them.")
@click.option("--queue", "queue_only", is_flag=True, help="The queue demo: writers, ticker and a consumer.")
def demo(seconds: float, keep: bool, queue_only: bool) -> None:
    """Run the demo on throwaway local clusters: root, leaf, pgbench, live status, a final check."""
    if queue_only:
        from pgcascade.dev.demo_queue import run_queue_demo

        run_queue_demo(seconds=seconds, keep=keep)
    else:
        from pgcascade.dev.demo import run_demo

        run_demo(seconds=seconds, keep=keep)


# --- Londiste 2 commands (seed 000): provider_db, subscriber_db, pgq_queue_name ------------------


@cli.group("provider")
def provider_group() -> None:
    """Londiste 2 provider commands: they act on provider_db."""


@provider_group.command("install")
@pass_ctx
def provider_install(ctx: Context) -> None:
    """Make provider_db the root of the set (node "provider")."""
    with ctx.connect(connstr=ctx.provider_db()) as conn:
        created = nodes.create_root(conn, ctx.queue(), "provider", ctx.provider_db())
    click.echo(f"provider of {ctx.queue()}: {'installed' if created else 'installed already'}")


@provider_group.command("add")
@click.argument("tables", nargs=-1, required=True)
@click.option("--format", "event_format", default="json", show_default=True, help="json or sql.")
@pass_ctx
def provider_add(ctx: Context, tables: tuple[str, ...], event_format: str) -> None:
    """Capture changes of TABLES on the provider."""
    with ctx.connect(connstr=ctx.provider_db()) as conn:
        ctx.node(conn)
        added = capture.add_tables(conn, ctx.queue(), list(tables), event_format=event_format)
    for t in added:
        click.echo(f"added {t}")


@provider_group.command("remove")
@click.argument("tables", nargs=-1, required=True)
@pass_ctx
def provider_remove(ctx: Context, tables: tuple[str, ...]) -> None:
    """Stop capturing TABLES (the tables and their rows stay)."""
    with ctx.connect(connstr=ctx.provider_db()) as conn:
        ctx.node(conn)
        removed = capture.remove_tables(conn, ctx.queue(), list(tables))
    for t in removed:
        click.echo(f"removed {t}")


@provider_group.command("tables")
@pass_ctx
def provider_tables(ctx: Context) -> None:
    """List the tables the provider captures."""
    with ctx.connect(connstr=ctx.provider_db()) as conn:
        ctx.node(conn)
        for t in capture.set_tables(conn, ctx.queue()):
            click.echo(t)


@provider_group.command("seqs")
@pass_ctx
def provider_seqs(ctx: Context) -> None:
    """List the sequences the provider replicates."""
    with ctx.connect(connstr=ctx.provider_db()) as conn:
        ctx.node(conn)
        for s in capture.set_seqs(conn, ctx.queue()):
            click.echo(s)


@cli.group("subscriber")
def subscriber_group() -> None:
    """Londiste 2 subscriber commands: they act on subscriber_db."""


@subscriber_group.command("install")
@pass_ctx
def subscriber_install(ctx: Context) -> None:
    """Make subscriber_db a leaf of the set fed by provider_db (node named after job_name)."""
    with ctx.connect() as conn:
        created = nodes.create_subscriber(
            conn, ctx.queue(), ctx.cfg.job_name, "leaf", ctx.db(), ctx.provider_db()
        )
    click.echo(
        f"subscriber {ctx.cfg.job_name} of {ctx.queue()}: {'installed' if created else 'installed already'}"
    )


@subscriber_group.command("add")
@click.argument("tables", nargs=-1, required=True)
@click.option("--expect-sync", is_flag=True, help="The table is in sync already; skip the copy.")
@click.option("--skip-truncate", is_flag=True, help="Keep the rows already there when copying.")
@click.option("--force", is_flag=True, help="Skip the structure check.")
@click.option("--create", is_flag=True, help="Create the table from the provider's definition.")
@pass_ctx
def subscriber_add(ctx: Context, tables: tuple[str, ...], **opts) -> None:
    """Replicate TABLES (the provider captures them already) into subscriber_db."""
    with ctx.connect() as conn:
        node = ctx.node(conn)
        with ctx.provider(conn, node) as prov:
            added = subscriber.add_tables(conn, prov, ctx.queue(), list(tables), **opts)
    for t in added:
        click.echo(f"added {t}")


@subscriber_group.command("remove")
@click.argument("tables", nargs=-1, required=True)
@pass_ctx
def subscriber_remove(ctx: Context, tables: tuple[str, ...]) -> None:
    """Stop replicating TABLES (the tables and their rows stay)."""
    with ctx.connect() as conn:
        ctx.node(conn)
        removed = subscriber.remove_tables(conn, ctx.queue(), list(tables))
    for t in removed:
        click.echo(f"removed {t}")


@subscriber_group.command("resync")
@click.argument("tables", nargs=-1, required=True)
@pass_ctx
def subscriber_resync(ctx: Context, tables: tuple[str, ...]) -> None:
    """Copy TABLES again."""
    with ctx.connect() as conn:
        ctx.node(conn)
        for t in subscriber.resync_tables(conn, ctx.queue(), list(tables)):
            click.echo(f"resync {t}")


@cli.command()
@daemon_switches
@pass_ctx
def replay(ctx: Context, detach: bool, ctl: str | None) -> None:
    """Londiste 2's name of the worker: replay the provider's events into subscriber_db."""
    from pgcascade.replica.worker import Worker

    if not ctl:
        refuse_worker_without_node(ctx)
    control_or_start(ctx, Worker, detach, ctl)


# --- entry point ------------------------------------------------------------------------------


def rewrite_argv(args: list[str]) -> list[str]:
    """`CONFIG.ini VERB ...` -> `--config CONFIG.ini VERB ...` (global options stay in front)."""
    opts = []
    rest = list(args)
    while rest and rest[0] in ("-v", "--verbose", "-q", "--quiet"):
        opts.append(rest.pop(0))
    if rest and not rest[0].startswith("-") and rest[0] not in cli.commands:
        return [*opts, "--config", rest[0], *rest[1:]]
    return [*opts, *rest]


def fail(message: str, code: int) -> None:
    click.echo(f"pgcascade: {redact(message)}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started in the background by a shell (which ignores SIGINT for it): a stop request
        # (`-s`) arriving before the daemon's own handler would otherwise be lost for good
        signal.signal(signal.SIGINT, signal.default_int_handler)
    args = rewrite_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        cli.main(args=args, prog_name="pgcascade", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help() if e.ctx else "", err=True)
        sys.exit(2)
    except click.UsageError as e:
        hint = f" (try: {e.ctx.command_path} --help)" if e.ctx else ""
        fail(f"{e.format_message()}{hint}", 2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        fail("aborted", 1)
    except UserError as e:
        fail(str(e), e.exit_code)
    except RuntimeFailure as e:
        fail(str(e), e.exit_code)
    except psycopg.Error as e:
        # before OperationalError: psycopg maps our 55xxx (wrong state) errors to OperationalError
        if is_user_sqlstate(e.sqlstate):
            fail(db_error_line(e), 2)
        elif isinstance(e, psycopg.OperationalError):
            fail(f"database: {db_error_line(e)}", 1)
        else:
            fail(db_error_line(e), 1)
    except KeyboardInterrupt:
        fail("interrupted", 1)
    except Exception as e:  # a bug: say so in one line; -v logs the traceback
        log.debug("internal error", exc_info=True)
        fail(f"internal error: {type(e).__name__}: {e} (run with -v for the traceback)", 1)


if __name__ == "__main__":
    main()
