"""Install and upgrade of the SQL that pgcascade keeps in every node database.

The schema lives in versioned files shipped with the package:

- `sql/migrations/NNNN_name.sql` change tables and types.  Each runs once, in order, and is
  recorded in `pgcascade.schema_version`; the schema version is the highest one applied.  One
  that is not recorded runs even when a higher one is (migrations are numbered per feature).
- `sql/pgq`, `sql/capture`, `sql/replica` hold the server-side functions of each role as
  `CREATE OR REPLACE`; they are applied again on every install, so an upgrade always leaves the
  functions of this release.  Their number prefixes order them across the directories (a SQL
  function's body may call only functions made before it).

- `sql/pgqcompat` is the `pgq` compatibility schema (PgQ 3's SQL API on pgcascade's queue,
  docs/pgq-compat.md).  It is applied by `install --pgq-compat`, and again by every later install
  of a database that has it.  A database where a real PgQ owns the schema `pgq` is refused.

Everything happens in one transaction under an advisory lock: two installers never interleave,
and a failed upgrade leaves the database as it was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from pgcascade.core.errors import UserError

INSTALL_LOCK_KEY = 0x70676361  # "pgca": the advisory lock that serializes installers


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def _sql_dir(sub: str):
    return resources.files("pgcascade").joinpath("sql", sub)


def migrations() -> list[Migration]:
    found = []
    for entry in _sql_dir("migrations").iterdir():
        m = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text()))
    return sorted(found, key=lambda m: m.version)


FUNCTION_DIRS = ("pgq", "capture", "replica")


def function_files() -> list[tuple[str, str]]:
    entries = [e for d in FUNCTION_DIRS for e in _sql_dir(d).iterdir() if e.name.endswith(".sql")]
    return [(e.name, e.read_text()) for e in sorted(entries, key=lambda e: e.name)]


LATEST_VERSION = migrations()[-1].version

PGQ_COMPAT_DIR = "pgqcompat"
# the comment the compatibility schema carries: tells it from a real PgQ's schema pgq
PGQ_COMPAT_MARK = "pgcascade: PgQ 3 compatibility API on the pgcascade queue"


def pgq_compat_files() -> list[tuple[str, str]]:
    entries = [e for e in _sql_dir(PGQ_COMPAT_DIR).iterdir() if e.name.endswith(".sql")]
    return [(e.name, e.read_text()) for e in sorted(entries, key=lambda e: e.name)]


def pgq_schema_owner(conn: psycopg.Connection) -> str | None:
    """Who owns the schema `pgq` here: 'pgcascade', 'pgq' (a real PgQ) or None (no such schema)."""
    row = conn.execute(
        "select obj_description(oid, 'pg_namespace') from pg_namespace where nspname = 'pgq'"
    ).fetchone()
    if row is None:
        return None
    return "pgcascade" if row[0] == PGQ_COMPAT_MARK else "pgq"


def installed_version(conn: psycopg.Connection) -> int:
    """The schema version in the database: 0 when pgcascade is not installed."""
    row = conn.execute("select to_regclass('pgcascade.schema_version') is not null").fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute("select coalesce(max(version), 0) from pgcascade.schema_version").fetchone()
    return int(row[0]) if row else 0


def install(
    conn: psycopg.Connection,
    target: int | None = None,
    with_functions: bool = True,
    pgq_compat: bool = False,
) -> tuple[int, int]:
    """Bring the schema to `target` (default: the latest); returns (version before, version after).

    `pgq_compat` adds the `pgq` compatibility schema; a database that has it keeps it up to date.
    `target` below the latest and `with_functions=False` exist to build old versions in tests.
    """
    target = LATEST_VERSION if target is None else target
    with conn.transaction():
        conn.execute("select pg_advisory_xact_lock(%s)", (INSTALL_LOCK_KEY,))
        before = installed_version(conn)
        if before > LATEST_VERSION:
            raise RuntimeError(
                f"database has pgcascade schema version {before}, newer than this release ({LATEST_VERSION})"
            )
        conn.execute("create schema if not exists pgcascade")
        conn.execute(
            "create table if not exists pgcascade.schema_version ("
            " version int4 primary key, name text not null,"
            " applied_at timestamptz not null default now())"
        )
        # every migration not recorded yet, not only those above the highest: a database built
        # from a development tree may hold a later one without an earlier one
        applied = {r[0] for r in conn.execute("select version from pgcascade.schema_version")}
        for m in migrations():
            if m.version not in applied and m.version <= target:
                conn.execute(m.sql.encode())
                conn.execute(
                    "insert into pgcascade.schema_version (version, name) values (%s, %s)",
                    (m.version, m.name),
                )
        if with_functions:
            for _name, sql in function_files():
                conn.execute(sql.encode())
            owner = pgq_schema_owner(conn)
            if pgq_compat and owner == "pgq":
                raise UserError(
                    "this database has a real PgQ (schema pgq): the pgq compatibility schema "
                    "can only go where PgQ is not installed (drop PgQ first, e.g. after import-londiste)"
                )
            if pgq_compat or owner == "pgcascade":
                for _name, sql in pgq_compat_files():
                    conn.execute(sql.encode())
        return before, max(before, target)
