"""What pgcascade's role needs on a node: checked before a node is set up, and named with the
grant to run when a daemon is refused (docs/operations.md, "Security").

pgcascade runs as one ordinary role per node, the owner of the tables it replicates there and
of the schema pgcascade (the first install creates it: CREATE on the database).  Beyond that:

- a node that applies changes (branch, leaf, two-way master) runs its apply transactions with
  session_replication_role = replica, so that the subscriber's triggers, foreign keys and write
  protection do not fire for replicated rows: SET on that parameter (PostgreSQL 15+), superuser
  before;
- a root with logical capture creates and reads a replication slot: REPLICATION;
- a two-way master with logical capture marks what it applies with a replication origin:
  EXECUTE on the pg_replication_origin functions (PostgreSQL 14+), superuser before.

Each check asks the server what it decides (a SET tried and rolled back, role membership), so
a managed service's admin roles (rds_superuser, rds_replication, ...) count as they do there.
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass

import psycopg
from psycopg.conninfo import conninfo_to_dict

from pgcascade.core.errors import UserError, db_error_line, redact
from pgcascade.core.pgconn import one, scalar

# the server functions a two-way master with logical capture calls (capture/logical.py)
ORIGIN_FUNCTIONS = (
    "pg_replication_origin_create",
    "pg_replication_origin_drop",
    "pg_replication_origin_session_setup",
)
# roles of managed services that carry what REPLICATION does elsewhere (Amazon RDS, Aurora)
MANAGED_REPLICATION_ROLES = ("rds_replication", "rds_superuser")
DOCS = 'docs/operations.md, "Security"'


class MissingGrant(UserError):
    """pgcascade's role lacks a privilege the command needs: one line naming the grant to run."""


@dataclass(frozen=True)
class Missing:
    what: str  # what the role lacks
    why: str  # what pgcascade needs it for
    grant: str  # the statement that gives it, and who may run it

    def line(self, role: str) -> str:
        return f"role {quote_ident(role)} lacks {self.what} ({self.why}): {self.grant}"


def quote_ident(name: str) -> str:
    """A role name as it must be written in the grant to run."""
    return name if re.fullmatch(r"[a-z_][a-z0-9_$]*", name) else '"' + name.replace('"', '""') + '"'


def require(conn: psycopg.Connection, *missing: Missing | None, where: str | None = None) -> None:
    """Refuse, in one line naming each grant, when anything is missing (`where`: the node the
    connection is to, when it is not this one)."""
    found = [m for m in missing if m is not None]
    if found:
        role = scalar(conn, "select current_user")
        lines = "; ".join(m.line(role) for m in found)
        raise MissingGrant(f"{where}: {lines}" if where else lines)


def _is_superuser(conn: psycopg.Connection) -> bool:
    return bool(scalar(conn, "select rolsuper from pg_roles where rolname = current_user"))


def _version(conn: psycopg.Connection) -> int:
    return conn.info.server_version


def replica_role_grant(role: str, version: int) -> str:
    """The grant that lets `role` set session_replication_role (version 0: not known)."""
    grant = f"as a superuser, GRANT SET ON PARAMETER session_replication_role TO {quote_ident(role)}"
    if version == 0:
        return f"{grant} (PostgreSQL 15+; before 15 only superusers may set it)"
    if version >= 150000:
        return grant
    return (
        f"PostgreSQL {version // 10000} lets only superusers set it: ALTER ROLE {quote_ident(role)} SUPERUSER,"
        f" or on a managed service its admin role ({DOCS})"
    )


def replica_role(conn: psycopg.Connection) -> Missing | None:
    """A node that applies changes: may this role set session_replication_role?  Tried in a
    transaction rolled back, so the server's own rule decides (a managed service's too)."""
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("set local session_replication_role = replica")
    except psycopg.errors.InsufficientPrivilege:
        role = scalar(conn, "select current_user")
        return Missing(
            "the right to set session_replication_role",
            "a subscriber applies replicated rows with it",
            replica_role_grant(role, _version(conn)),
        )
    return None


def replication(conn: psycopg.Connection) -> Missing | None:
    """A root with logical capture: may this role create and read a replication slot?"""
    has_it = scalar(
        conn,
        "select r.rolsuper or r.rolreplication or exists (select from pg_roles m"
        " where m.rolname = any(%s) and pg_has_role(m.oid, 'member'))"
        " from pg_roles r where r.rolname = current_user",
        (list(MANAGED_REPLICATION_ROLES),),
    )
    if has_it:
        return None
    role = quote_ident(scalar(conn, "select current_user"))
    return Missing(
        "REPLICATION",
        "logical capture reads a replication slot",
        f"as a superuser, ALTER ROLE {role} REPLICATION (Amazon RDS, Aurora: GRANT rds_replication TO {role})",
    )


def replication_origins(conn: psycopg.Connection) -> Missing | None:
    """A two-way master with logical capture: may this role use replication origins?"""
    if _is_superuser(conn):
        return None
    role = quote_ident(scalar(conn, "select current_user"))
    if _version(conn) < 140000:
        return Missing(
            "superuser",
            "PostgreSQL 13 lets only superusers use replication origins (two-way with logical capture)",
            f"ALTER ROLE {role} SUPERUSER, or trigger capture on this master",
        )
    lacking = conn.execute(
        "select p.oid::regprocedure::text from pg_proc p where p.pronamespace = 'pg_catalog'::regnamespace"
        " and p.proname = any(%s) and not has_function_privilege(p.oid, 'execute') order by 1",
        (list(ORIGIN_FUNCTIONS),),
    ).fetchall()
    if not lacking:
        return None
    return Missing(
        "EXECUTE on " + ", ".join(r[0] for r in lacking),
        "two-way with logical capture marks applied changes with a replication origin",
        f"as a superuser, GRANT EXECUTE ON FUNCTION {', '.join(r[0] for r in lacking)} TO {role}",
    )


def schema(conn: psycopg.Connection, installs: bool = True) -> Missing | None:
    """Every node: the role installs and upgrades the schema pgcascade, so it owns it (or may
    create it: CREATE on the database).  `installs` False: another node's, which is not
    installed there by this command (its absence is said otherwise)."""
    role = quote_ident(scalar(conn, "select current_user"))
    row = conn.execute(
        "select nspowner::regrole::text, pg_has_role(nspowner, 'usage') from pg_namespace where nspname = 'pgcascade'"
    ).fetchone()
    if row is not None:
        owner, owned = row
        if owned:
            return None
        return Missing(
            f"ownership of schema pgcascade (owner: {owner})",
            "pgcascade's role installs and upgrades its functions there",
            f"connect as {owner}, or GRANT {owner} TO {role}",
        )
    if not installs:
        return None
    db, can_create = one(
        conn, "select current_database(), has_database_privilege(current_database(), 'create')"
    )
    if can_create:
        return None
    return Missing(
        f"CREATE on database {db}",
        "the first install creates the schema pgcascade",
        f"ALTER DATABASE {quote_ident(db)} OWNER TO {role}, or GRANT CREATE ON DATABASE {quote_ident(db)} TO {role}",
    )


def owner_of(conn: psycopg.Connection, tables: list[str]) -> Missing | None:
    """The tables pgcascade replicates (captures, copies into, protects) are its role's: those
    among `tables` it does not own (directly or through a role it inherits; missing ones pass)."""
    rows = conn.execute(
        "select t, c.relowner::regrole::text from unnest(%s::text[]) t join pg_class c on c.oid = to_regclass(t)"
        " where not pg_has_role(c.relowner, 'usage') order by 1",
        (tables,),
    ).fetchall()
    if not rows:
        return None
    role = quote_ident(scalar(conn, "select current_user"))
    owners = sorted({o for _, o in rows})
    return Missing(
        "ownership of " + ", ".join(f"{t} (owner: {o})" for t, o in rows),
        "pgcascade's role owns the tables it replicates",
        "; ".join(f"ALTER TABLE {t} OWNER TO {role}" for t, _ in rows[:3])
        + (" ..." if len(rows) > 3 else "")
        + f" (or GRANT {', '.join(owners)} TO {role})",
    )


def create_in(conn: psycopg.Connection, schema_name: str) -> Missing | None:
    """add-table --create: the role makes the table (and its schema if it is missing)."""
    exists, can = one(
        conn,
        "select n.oid is not null, coalesce(has_schema_privilege(n.oid, 'create'),"
        " has_database_privilege(current_database(), 'create'))"
        " from (select %s::text as name) x left join pg_namespace n on n.nspname = x.name",
        (schema_name,),
    )
    if can:
        return None
    role = quote_ident(scalar(conn, "select current_user"))
    if exists:
        return Missing(
            f"CREATE on schema {schema_name}",
            "--create makes the table",
            f"GRANT CREATE ON SCHEMA {quote_ident(schema_name)} TO {role}",
        )
    db = scalar(conn, "select current_database()")
    return Missing(
        f"CREATE on database {db}",
        f"--create makes the schema {schema_name}",
        f"GRANT CREATE ON DATABASE {quote_ident(db)} TO {role}",
    )


# --- a daemon refused ------------------------------------------------------------------------------

# a refusal for want of a privilege: insufficient_privilege, or a connection the server refused
# for one (a failed connection carries no SQLSTATE, only the server's FATAL message)
_REFUSED = re.compile(r"permission denied|must be superuser|must be owner|only superusers")
_DENIED_ON = re.compile(
    r"(?:permission denied for|must be owner of) (table|relation|sequence|schema|database) (\S+)"
)


def role_of(dsn: str | None) -> str:
    """The role a connection string logs in as, as libpq picks it (service files aside)."""
    try:
        user = conninfo_to_dict(dsn or "").get("user")
    except psycopg.ProgrammingError:
        user = None
    return str(user or os.environ.get("PGUSER") or getpass.getuser())


def is_refusal(e: Exception) -> bool:
    """Whether the server refused for want of a privilege."""
    return isinstance(e, psycopg.errors.InsufficientPrivilege) or (
        isinstance(e, psycopg.OperationalError) and bool(_REFUSED.search(str(e)))
    )


def explain(e: Exception, dsn: str | None, version: int = 0) -> str:
    """One line for a failed round of a daemon connected with `dsn` (for its log and `status`):
    the server's message, and for a missing privilege the grant to run."""
    if not isinstance(e, psycopg.Error):
        return redact(str(e)).strip()
    line = db_error_line(e)
    if not is_refusal(e):
        return line
    return f"{line}: {grant_hint(line, role_of(dsn), version)}"


def grant_hint(line: str, role: str, version: int) -> str:
    """What to run for the insufficient_privilege error `line` of `role`."""
    if "session_replication_role" in line:
        return replica_role_grant(role, version)
    role = quote_ident(role)
    if "replication slot" in line or "replication role" in line or "walsender" in line:
        return f"as a superuser, ALTER ROLE {role} REPLICATION (Amazon RDS, Aurora: GRANT rds_replication TO {role})"
    if "pg_replication_origin" in line:
        return f"as a superuser, GRANT EXECUTE ON FUNCTION {', '.join(f + '(text)' for f in ORIGIN_FUNCTIONS)} TO {role}"
    m = _DENIED_ON.search(line)
    if m and m.group(1) == "schema" and m.group(2) == "pgcascade":
        return "connect as the owner of schema pgcascade, the role that installed it"
    if m and m.group(1) == "database":  # at login: CONNECT; later: CREATE (the schema)
        needed = "CONNECT" if "FATAL" in line else "CREATE"
        return f"GRANT {needed} ON DATABASE {m.group(2)} TO {role}"
    if m and m.group(1) in ("table", "relation", "sequence"):
        return f"pgcascade's role owns the tables it replicates: ALTER TABLE {m.group(2)} OWNER TO {role}"
    return f"a privilege pgcascade's role needs is missing ({DOCS})"
