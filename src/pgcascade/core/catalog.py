"""Reading table definitions from PostgreSQL's catalog: names, keys, columns, indexes.

Names given by users follow Londiste's rule: a bare name means `public.NAME`, never the
search_path.  Quoted names are parsed by the server (`parse_ident`), so capitals, spaces,
quotes and unicode work; `*` and `?` make a glob over unquoted names.  A table's canonical
name is `format('%I.%I', schema, table)` - the form events carry in ev_extra1.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import psycopg

from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import scalar

SYSTEM_SCHEMAS = ("pg_catalog", "information_schema", "pgcascade", "pg_toast")


@dataclass(frozen=True)
class TableRef:
    schema: str
    name: str
    canonical: str  # format('%I.%I', schema, name)
    oid: int


def split_name(conn: psycopg.Connection, name: str) -> tuple[str, str]:
    """'t' -> ('public', 't'); 's.t' -> ('s', 't'); quoted parts keep their case and characters."""
    try:
        parts = scalar(conn, "select parse_ident(%s)", (name,))
    except psycopg.Error:
        raise UserError(f"invalid table name: {name!r}") from None
    if len(parts) == 1:
        return "public", parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise UserError(f"invalid table name (schema.table expected): {name!r}")


def canonical(conn: psycopg.Connection, name: str) -> str:
    """A user's name for a relation -> format('%I.%I', schema, name), whether it exists or not."""
    sch, rel = split_name(conn, name)
    return scalar(conn, "select format('%%I.%%I', %s::text, %s::text)", (sch, rel))


def relations(conn: psycopg.Connection, kinds: str) -> list[TableRef]:
    rows = conn.execute(
        "select n.nspname, c.relname, format('%%I.%%I', n.nspname, c.relname), c.oid::int8"
        " from pg_class c join pg_namespace n on n.oid = c.relnamespace"
        " where c.relkind = any(%s) and not c.relispartition and n.nspname <> all(%s)"
        " and n.nspname not like 'pg\\_temp%%' order by 1, 2",
        (list(kinds), list(SYSTEM_SCHEMAS)),
    ).fetchall()
    return [TableRef(*r) for r in rows]


def resolve(
    conn: psycopg.Connection, patterns: list[str], kinds: str = "rp", what: str = "table"
) -> list[TableRef]:
    """The relations that names or globs denote; an unmatched name is an error naming it."""
    found: dict[str, TableRef] = {}
    existing = None
    for pat in patterns:
        if "*" in pat or "?" in pat:
            existing = existing if existing is not None else relations(conn, kinds)
            sch, _, tab = pat.rpartition(".")
            sch = sch or "public"
            matches = [
                t for t in existing if fnmatch.fnmatchcase(t.schema, sch) and fnmatch.fnmatchcase(t.name, tab)
            ]
            if not matches:
                raise UserError(f"no {what} matches {pat!r}")
            for t in matches:
                found[t.canonical] = t
            continue
        sch, tab = split_name(conn, pat)
        row = conn.execute(
            "select n.nspname, c.relname, format('%%I.%%I', n.nspname, c.relname), c.oid::int8"
            " from pg_class c join pg_namespace n on n.oid = c.relnamespace"
            " where n.nspname = %s and c.relname = %s and c.relkind = any(%s)",
            (sch, tab, list(kinds)),
        ).fetchone()
        if row is None:
            raise UserError(f"{what} {pat!r} does not exist (looked for {sch}.{tab})")
        t = TableRef(*row)
        found[t.canonical] = t
    return list(found.values())


def all_tables(conn: psycopg.Connection) -> list[TableRef]:
    return relations(conn, "rp")


def primary_key(conn: psycopg.Connection, oid: int) -> list[str] | None:
    row = conn.execute(
        "select array_agg(a.attname::text order by k.ord) from pg_index i"
        " cross join lateral unnest(i.indkey) with ordinality k(attnum, ord)"
        " join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.attnum"
        " where i.indrelid = %s and i.indisprimary",
        (oid,),
    ).fetchone()
    return row[0] if row and row[0] else None


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # format_type()
    not_null: bool
    generated: bool
    identity: bool
    has_default: bool


def columns(conn: psycopg.Connection, table: str) -> list[Column]:
    """The columns of `table` (a canonical name), in order."""
    rows = conn.execute(
        "select attname::text, format_type(atttypid, atttypmod), attnotnull, attgenerated <> '',"
        " attidentity <> '', atthasdef from pg_attribute"
        " where attrelid = %s::regclass and attnum > 0 and not attisdropped order by attnum",
        (table,),
    ).fetchall()
    return [Column(*r) for r in rows]


@dataclass(frozen=True)
class ColumnDefault:
    name: str
    default: str | None  # the expression (identity columns: None)
    sequence: str | None  # the sequence it draws from (identity, serial or nextval default)
    owned: bool  # the sequence belongs to this column (serial, identity)
    identity: bool


def column_defaults(conn: psycopg.Connection, table: str) -> dict[str, ColumnDefault]:
    """How each column of `table` gets a value when an insert leaves it out."""
    rows = conn.execute(
        "select a.attname::text, pg_get_expr(d.adbin, d.adrelid),"
        " coalesce(o.seq,"
        "  (select format('%%I.%%I', n.nspname, s.relname) from pg_depend dep"
        "   join pg_class s on s.oid = dep.refobjid and s.relkind = 'S'"
        "   join pg_namespace n on n.oid = s.relnamespace"
        "   where dep.classid = 'pg_attrdef'::regclass and dep.objid = d.oid"
        "   and dep.refclassid = 'pg_class'::regclass limit 1)),"
        " o.seq is not null, a.attidentity <> ''"
        " from pg_attribute a left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum"
        " cross join lateral (select pg_get_serial_sequence(%s, a.attname) seq) o"
        " where a.attrelid = %s::regclass and a.attnum > 0 and not a.attisdropped and a.attgenerated = ''"
        " order by a.attnum",
        (table, table),
    ).fetchall()
    return {r[0]: ColumnDefault(*r) for r in rows}


def sequence_value(conn: psycopg.Connection, seq: str) -> int | None:
    """The last value the sequence gave (None: never used)."""
    return scalar(conn, "select pg_sequence_last_value(%s::regclass)", (seq,))


def has_unique_index_on(conn: psycopg.Connection, table: str, keys: list[str]) -> bool:
    """Whether a valid, non-partial unique index covers exactly `keys` (needed by ON CONFLICT)."""
    row = conn.execute(
        "select exists (select 1 from pg_index i where i.indrelid = %s::regclass and i.indisunique"
        " and i.indisvalid and i.indpred is null and i.indexprs is null"
        " and (select array_agg(a.attname::text order by a.attname) from pg_attribute a"
        "      where a.attrelid = i.indrelid and a.attnum = any(i.indkey))"
        "     = (select array_agg(k order by k) from unnest(%s::text[]) k)"
        " and cardinality(i.indkey) = cardinality(%s::text[]))",
        (table, keys, keys),
    ).fetchone()
    return bool(row and row[0])


def has_json_columns(conn: psycopg.Connection, table: str) -> bool:
    """Whether `table` has json/jsonb columns: its events may mark JSON nulls (89_json_nulls.sql)."""
    return scalar(conn, "select exists (select 1 from pgcascade.json_columns(%s::regclass))", (table,))


def is_partitioned(conn: psycopg.Connection, table: str) -> bool:
    """A partitioned table has no rows of its own: ONLY would copy or truncate nothing (or fail)."""
    return scalar(conn, "select relkind = 'p' from pg_class where oid = %s::regclass", (table,))


def table_exists(conn: psycopg.Connection, table: str) -> bool:
    return scalar(conn, "select to_regclass(%s) is not null", (table,))


def estimated_rows(conn: psycopg.Connection, table: str) -> int | None:
    """The planner's row estimate of the table and its partitions; None when never analysed."""
    return scalar(
        conn,
        "select (sum(c.reltuples) filter (where c.reltuples >= 0))::int8 from pg_class c"
        " where c.oid = %s::regclass or c.oid in (select relid from pg_partition_tree(%s::regclass))",
        (table, table),
    )


def foreign_key_links(conn: psycopg.Connection, tables: list[str]) -> list[tuple[str, str]]:
    """Pairs of `tables` (as given) that a foreign key joins, either way; triggers and rules
    are not followed."""
    rows = conn.execute(
        "select a.name, b.name from unnest(%s::text[]) a(name)"
        " join pg_constraint c on c.contype = 'f' and c.conrelid = a.name::regclass"
        " join unnest(%s::text[]) b(name) on c.confrelid = b.name::regclass",
        (tables, tables),
    ).fetchall()
    return [(a, b) for a, b in rows]
