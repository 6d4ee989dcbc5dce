"""`pgcascade`: one command, Londiste-style verbs.

    pgcascade CONFIG.ini VERB [ARGS]       a verb on the job that CONFIG.ini describes
    pgcascade ticker CONFIG.ini [-d|-s|-k|-r]
    pgcascade CONFIG.ini capture [-d|-s|-k|-r]   the root's logical capture daemon
    pgcascade demo

The config comes first, as in Londiste; main() moves it behind `--config` for click.  Each
verb lives in the module of its group (nodes, tables, cascade, daemons, queues, pipeline,
londiste2, demo), imported when the verb runs, and only parses arguments and calls a role
package.  Every failure ends in one
line on stderr and the exit code of DESIGN.md: 0 ok, 1 runtime failure, 2 usage or config
error.  Tracebacks are for bugs only (and go to the log with -v).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from types import ModuleType

import click
import psycopg

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


# verb -> the module of its group.  A verb's module is imported when the verb runs, so each
# command loads only the role packages it uses (the start-up of `pgcascade CONF status` does not
# pay for Spark's modules or the demo's); tests/unit checks this table against the modules.
VERBS = {
    **dict.fromkeys(["install", "create-root", "create-branch", "create-leaf"], "nodes"),
    **dict.fromkeys(
        ["add-table", "remove-table", "tables", "missing", "resync", "add-seq", "remove-seq", "seqs"],
        "tables",
    ),
    **dict.fromkeys(["execute", "wait-sync"], "tables"),
    **dict.fromkeys(["members", "change-provider", "takeover", "resurrect", "drop-node"], "cascade"),
    **dict.fromkeys(["pause", "resume", "wait-root", "wait-provider"], "cascade"),
    **dict.fromkeys(["ticker", "worker", "capture", "copy"], "daemons"),
    **dict.fromkeys(["queue", "status", "config", "serve"], "queues"),
    **dict.fromkeys(["compare", "repair", "spark-server", "sink", "recover-slot"], "pipeline"),
    **dict.fromkeys(["provider", "subscriber", "replay"], "londiste2"),
    **dict.fromkeys(["import-londiste", "drop-londiste", "back-to-londiste"], "londiste3"),
    **dict.fromkeys(["add-peer", "conflicts"], "twoway"),
    "auto-ddl": "ddl",
    "demo": "demo",
    "completion": "shell",
}


class Verbs(click.Group):
    """The verbs, each loaded from its module when it is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in VERBS:
            return None
        module = importlib.import_module(f"pgcascade.cli.{VERBS[name]}")
        return module_verbs(module).get(name)


def module_verbs(module: ModuleType) -> dict[str, click.Command]:
    """verb -> command of a verb module (its COMMANDS, and its ALIASES if it has any)."""
    commands: dict[str, click.Command] = {c.name: c for c in module.COMMANDS if c.name}
    return {**commands, **getattr(module, "ALIASES", {})}


@click.group(cls=Verbs, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", hidden=True)
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
@click.option("-q", "--quiet", is_flag=True, help="Log only to the logfile.")
@click.version_option(package_name="pgcascade")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, verbose: bool, quiet: bool) -> None:
    """pgcascade CONFIG.ini VERB [ARGS] - cascaded replication for PostgreSQL."""
    ctx.obj = Context(config_path, verbose, quiet)
    setup_logging(None, verbose=verbose, quiet=quiet)


def rewrite_argv(args: list[str], verbs: set[str] | None = None) -> list[str]:
    """`CONFIG.ini VERB ...` -> `--config CONFIG.ini VERB ...` (global options stay in front)."""
    verbs = set(VERBS) if verbs is None else verbs
    opts = []
    rest = list(args)
    while rest and rest[0] in ("-v", "--verbose", "-q", "--quiet"):
        opts.append(rest.pop(0))
    if rest and not rest[0].startswith("-") and rest[0] not in verbs:
        return [*opts, "--config", rest[0], *rest[1:]]
    return [*opts, *rest]


def complete_after_config() -> None:
    """Shell completion sees the words as typed (`pgcascade job.ini add-<TAB>`): put the config
    behind --config there too, as rewrite_argv does for a run (not the word being completed)."""
    words = os.environ["COMP_WORDS"].split()
    cword = int(os.environ.get("COMP_CWORD", len(words)))
    done = [words[0], *rewrite_argv(words[1:cword])]
    os.environ["COMP_WORDS"] = " ".join(done + words[cword:])
    os.environ["COMP_CWORD"] = str(len(done))


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
    if os.environ.get("_PGCASCADE_COMPLETE") and "COMP_WORDS" in os.environ:
        complete_after_config()
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
