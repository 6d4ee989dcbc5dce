"""`pgcascade`: one command, Londiste-style verbs.

    pgcascade CONFIG.ini VERB [ARGS]       a verb on the job that CONFIG.ini describes
    pgcascade ticker CONFIG.ini [-d|-s|-k|-r]
    pgcascade demo

The config comes first, as in Londiste; main() moves it behind `--config` for click.
Every failure ends in one line on stderr and the exit code of DESIGN.md: 0 ok, 1 runtime
failure, 2 usage or config error.  Tracebacks are for bugs only (and go to the log with -v).
"""

from __future__ import annotations

import logging
import signal
import sys

import click
import psycopg

from pgcascade import queue as q
from pgcascade import schema
from pgcascade.config import JobConfig, load_config
from pgcascade.daemon import setup_logging, signal_daemon
from pgcascade.errors import RuntimeFailure, UserError, db_error_line, redact

log = logging.getLogger("pgcascade")

# SQLSTATEs our SQL functions raise for bad input: unknown object, invalid parameter, wrong state.
USER_SQLSTATES = {"P0002", "22023", "22004", "55000", "55006"}


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
        return self.cfg.db

    def connect(self, autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(self.db(), autocommit=autocommit, connect_timeout=10)


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
    from pgcascade.ticker import Ticker

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
    """Show queues and consumers of the job's database, with lag."""
    from pgcascade.status import print_queue_status

    with ctx.connect() as conn:
        print_queue_status(conn)


@cli.command()
@click.option("--seconds", default=20.0, show_default=True, help="How long the workload runs.")
@click.option("--keep", is_flag=True, help="Leave the clusters running and print how to reach them.")
def demo(seconds: float, keep: bool) -> None:
    """Run the demo on throwaway local clusters."""
    from pgcascade.demo import run_demo

    run_demo(seconds=seconds, keep=keep)


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
    args = rewrite_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        cli.main(args=args, prog_name="pgcascade", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help() if e.ctx else "", err=True)
        sys.exit(2)
    except click.UsageError as e:
        hint = f" (try: pgcascade {e.ctx.command_path.split(' ', 1)[-1]} --help)" if e.ctx else ""
        fail(f"{e.format_message()}{hint}", 2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        fail("aborted", 1)
    except UserError as e:
        fail(str(e), e.exit_code)
    except RuntimeFailure as e:
        fail(str(e), e.exit_code)
    except psycopg.OperationalError as e:
        fail(f"database: {db_error_line(e)}", 1)
    except psycopg.Error as e:
        fail(db_error_line(e), 2 if e.sqlstate in USER_SQLSTATES else 1)
    except KeyboardInterrupt:
        fail("interrupted", 1)
    except Exception as e:  # a bug: say so in one line; -v logs the traceback
        log.debug("internal error", exc_info=True)
        fail(f"internal error: {type(e).__name__}: {e} (run with -v for the traceback)", 1)


if __name__ == "__main__":
    main()
