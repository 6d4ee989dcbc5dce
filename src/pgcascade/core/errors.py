"""Errors that reach the user as one line and an exit code (see DESIGN.md, "Exit codes")."""

from __future__ import annotations

import re

import psycopg


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    pass


class RuntimeFailure(Exception):
    """Something failed at run time (a database, a process); one line, exit code 1."""

    exit_code = 1


_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"(postgres(?:ql)?://[^:/@\s]+:)([^@\s]+)(@)")


def redact(text: str) -> str:
    """Hide passwords in connection strings before they reach a log or the screen."""
    if "://" not in text and "assword" not in text.lower():  # (most lines: no regex to run)
        return text
    return _URI_PASSWORD.sub(r"\1***\3", _PASSWORD.sub(r"\1***", text))


def db_error_line(e: psycopg.Error) -> str:
    """The server's message of a database error, on one line, without passwords."""
    diag = getattr(e, "diag", None)
    msg = (diag.message_primary if diag is not None else None) or str(e)
    return redact(" ".join(msg.split()))
