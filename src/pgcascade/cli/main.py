"""`pgcascade`: one command, Londiste-style verbs.

    pgcascade CONFIG.ini VERB [ARGS]       a verb on the job that CONFIG.ini describes
    pgcascade ticker CONFIG.ini [-d|-s|-k|-r]
    pgcascade CONFIG.ini capture [-d|-s|-k|-r]   the root's logical capture daemon
    pgcascade demo

The config comes first, as in Londiste; main() moves it behind `--config` for click.  Each
verb lives in the module of its group (nodes, tables, cascade, daemons, queues, pipeline,
londiste2, demo) and only parses arguments and calls a role package.  Every failure ends in one
line on stderr and the exit code of DESIGN.md: 0 ok, 1 runtime failure, 2 usage or config
error.  Tracebacks are for bugs only (and go to the log with -v).
"""

from __future__ import annotations

import logging
import signal
import sys

import click
import psycopg

from pgcascade.cli import cascade, daemons, demo, londiste2, nodes, pipeline, queues, tables
from pgcascade.cli.context import Context
from pgcascade.core.daemon import setup_logging
from pgcascade.core.errors import RuntimeFailure, UserError, db_error_line, redact

log = logging.getLogger("pgcascade")

# SQLSTATEs our SQL functions raise for bad input: unknown object, invalid parameter, wrong state.
USER_SQLSTATES = {"P0002", "22023", "22004", "55000", "55006"}
# SQLSTATE classes that are the user's input too: 22 = data exception (a value that is not an
# interval, an integer out of range, ... as in `queue config q ticker_max_lag=soon`).
USER_SQLSTATE_CLASSES = {"22"}


def is_user_sqlstate(sqlstate: str | None) -> bool:
    return sqlstate is not None and (sqlstate in USER_SQLSTATES or sqlstate[:2] in USER_SQLSTATE_CLASSES)


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


for module in (nodes, tables, cascade, daemons, queues, pipeline, londiste2, demo):
    for command in module.COMMANDS:
        cli.add_command(command)
for alias, command in londiste2.ALIASES.items():
    cli.add_command(command, alias)


def rewrite_argv(args: list[str], verbs: set[str] | None = None) -> list[str]:
    """`CONFIG.ini VERB ...` -> `--config CONFIG.ini VERB ...` (global options stay in front)."""
    verbs = set(cli.commands) if verbs is None else verbs
    opts = []
    rest = list(args)
    while rest and rest[0] in ("-v", "--verbose", "-q", "--quiet"):
        opts.append(rest.pop(0))
    if rest and not rest[0].startswith("-") and rest[0] not in verbs:
        return [*opts, "--config", rest[0], *rest[1:]]
    return [*opts, *rest]


def fail(message: str, code: int) -> None:
    click.echo(f"pgcascade: {redact(message)}", err=True)
    sys.exit(code)


def exit_for_database_error(e: psycopg.Error) -> None:
    # before OperationalError: psycopg maps our 55xxx (wrong state) errors to OperationalError
    if is_user_sqlstate(e.sqlstate):
        fail(db_error_line(e), 2)
    elif isinstance(e, psycopg.OperationalError):
        fail(f"database: {db_error_line(e)}", 1)
    else:
        fail(db_error_line(e), 1)


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
    except (UserError, RuntimeFailure) as e:
        fail(str(e), e.exit_code)
    except psycopg.Error as e:
        exit_for_database_error(e)
    except KeyboardInterrupt:
        fail("interrupted", 1)
    except Exception as e:  # a bug: say so in one line; -v logs the traceback
        log.debug("internal error", exc_info=True)
        fail(f"internal error: {type(e).__name__}: {e} (run with -v for the traceback)", 1)


if __name__ == "__main__":
    main()
