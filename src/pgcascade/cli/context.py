"""What every verb shares: the job's config, its connections, this node, the daemon switches.

A verb module only parses its arguments and calls a role package; the connection and the node
it acts on come from here.  The seed's Londiste 2 `provider ...` verbs act on `provider_db`
instead of `db` (`use_provider_db`), and are otherwise the same verbs.
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Callable, Iterator

import click
import psycopg

from pgcascade.core import pgconn
from pgcascade.core.config import JobConfig, load_config, parse_duration
from pgcascade.core.daemon import Daemon, setup_logging, signal_daemon, use_connection_settings
from pgcascade.core.errors import ConfigError, UserError, db_error_line
from pgcascade.pgq import node as nodes


class Context:
    def __init__(self, config_path: str | None, verbose: bool = False, quiet: bool = False):
        self.config_path = config_path
        self.verbose = verbose
        self.quiet = quiet
        self._cfg: JobConfig | None = None
        self.provider_db_verbs = False  # the Londiste 2 `provider ...` verbs: act on provider_db

    @property
    def cfg(self) -> JobConfig:
        if self._cfg is None:
            if not self.config_path:
                raise UserError("this verb needs a config file: pgcascade CONFIG.ini VERB")
            self._cfg = load_config(self.config_path)
            use_connection_settings(self._cfg)
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: JobConfig) -> None:
        self._cfg = cfg

    def use_provider_db(self) -> None:
        self.provider_db_verbs = True

    def db(self) -> str:
        """The connection string the verb acts on: db, or provider_db for `provider ...`."""
        key = "provider_db" if self.provider_db_verbs else "db"
        dsn = self.cfg.provider_db if self.provider_db_verbs else self.cfg.db
        if not dsn:
            raise UserError(f"{self.cfg.path}: {key} is not set")
        try:
            psycopg.conninfo.conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as e:
            raise ConfigError(f"{self.cfg.path}: {key}: {db_error_line(e)}") from None
        return dsn

    def provider_db(self) -> str:
        """The seed's `provider_db` (Londiste 2 configs)."""
        if not self.cfg.provider_db:
            raise UserError(f"{self.cfg.path}: provider_db is not set")
        return self.cfg.provider_db

    def connect(self, autocommit: bool = True, connstr: str | None = None) -> psycopg.Connection:
        return pgconn.connect(connstr or self.db(), autocommit=autocommit, connect_timeout=10)

    def queue(self) -> str:
        if not self.cfg.queue_name:
            raise UserError(f"{self.cfg.path}: queue_name is not set")
        return self.cfg.queue_name

    def node(self, conn: psycopg.Connection) -> nodes.Node:
        return nodes.require_node(conn, self.queue())

    @contextlib.contextmanager
    def this_node(self) -> Iterator[tuple[psycopg.Connection, nodes.Node]]:
        """A connection to the job's database and the node it is."""
        with self.connect() as conn:
            yield conn, self.node(conn)

    def provider(self, conn: psycopg.Connection, node: nodes.Node) -> psycopg.Connection:
        return self.connect(connstr=nodes.provider_location(conn, node))


pass_ctx = click.make_pass_decorator(Context)


def say(line: str) -> None:
    """Progress of a long command, on stderr (stdout keeps the result)."""
    click.echo(line, err=True)


def note_secrets(dsns: dict[str, str]) -> None:
    """Say in one line which of the connection strings given (what -> string) had a password
    that is not stored (node locations never carry one: pgq.node.stored_location)."""
    named = []
    for what, dsn in dsns.items():
        with contextlib.suppress(psycopg.ProgrammingError):  # not one: storing it said why
            if pgconn.has_secret(dsn):
                named.append(what)
    if named:
        click.echo(
            f"the password in {' and '.join(named)} is not stored: each node that connects takes it from"
            ' its ~/.pgpass, a service file or PGPASSWORD (docs/operations.md, "Security")'
        )


def require_subscriber(node: nodes.Node, verb: str) -> None:
    if node.role.captures_changes:
        raise UserError(f"{verb} is a subscriber verb: the root has every table of the set")


class Duration(click.ParamType):
    """A length of time: 30, 30s, 500ms, 5min, 2h (seconds when no unit)."""

    name = "duration"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            seconds = parse_duration(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if seconds < 0:
            self.fail(f"{value!r}: a duration cannot be negative", param, ctx)
        return seconds


def echo_json(data: object) -> None:
    """A verb's result for scripts: one JSON document on stdout."""
    click.echo(json.dumps(data, indent=2, default=str))


def daemon_switches(f: Callable) -> Callable:
    """-d/-s/-k/-r as every Skytools daemon has them."""
    f = click.option(
        "-r", "--reload", "ctl", flag_value="reload", help="Make the running daemon reload its config."
    )(f)
    f = click.option("-k", "--kill", "ctl", flag_value="kill", help="Kill the running daemon.")(f)
    f = click.option(
        "-s", "--stop", "ctl", flag_value="stop", help="Stop the running daemon after its current work."
    )(f)
    return click.option("-d", "--daemon", "detach", is_flag=True, help="Run in the background.")(f)


SIGNALS = {"stop": signal.SIGINT, "kill": signal.SIGTERM, "reload": signal.SIGHUP}


def control_or_start(
    ctx: Context, make_daemon: Callable[[JobConfig], Daemon], detach: bool, ctl: str | None
) -> None:
    """Signal the job's running daemon (-s, -k, -r), or start one (-d: in the background)."""
    cfg = ctx.cfg
    if ctl:
        pid = signal_daemon(cfg, SIGNALS[ctl])
        click.echo(f"{cfg.job_name} (pid {pid}): {ctl} sent")
        return
    setup_logging(cfg.logfile, verbose=ctx.verbose, quiet=ctx.quiet, to_stderr=not detach)
    code = make_daemon(cfg).start(detach=detach)
    if code:
        raise SystemExit(code)  # it stopped on an error it logged (another daemon took its lock)
