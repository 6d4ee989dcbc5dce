"""Row filters and column lists of a subscriber's tables (`add-table --where P --columns a,b`).

A row filter is a boolean SQL expression over the table's columns that the DBA gives, as in
`CREATE PUBLICATION ... WHERE (...)`.  pgcascade embeds it in statements of its own - the set-based
apply, the row-by-row apply, the copy's `COPY (SELECT ...)`, compare and repair - so what it
embeds must be one expression and nothing else, whatever the text held.  The text is therefore
never used as typed:

1. The subscriber's server parses it as the CHECK constraint of a scratch temporary table made
   `LIKE` the destination, in a transaction that is rolled back.  The statement goes over the
   extended query protocol (a prepared statement), which refuses a second statement outright:
   `x = 1); drop table t; --` fails there, before anything runs.
2. What is stored and embedded is the server's own deparse of that constraint (`pg_get_expr`,
   with the search_path at `pg_catalog` so every other name comes out schema-qualified): one
   parenthesised expression by construction, the same under any session's search_path.
3. The scratch table must also take an index on the expression: PostgreSQL then refuses what a
   filter cannot use - functions that are not IMMUTABLE (`now()`, `random()`: the copy, every
   apply and compare must reach the same verdict on the same row), subqueries, aggregates,
   window and set-returning functions - and CHECK already refuses system columns.
4. The canonical expression must also run on the provider's table, where the copy, compare and
   repair evaluate it.

The apply evaluates the filter on the subscriber, on the row an event carries typed as the
destination's row, so it may use only columns the destination has.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from pgcascade.core import catalog
from pgcascade.core.errors import UserError, db_error_line
from pgcascade.pgq import node as nodes

SCRATCH = "pg_temp.pgcascade_filter_check"


@dataclass(frozen=True)
class Subset:
    """What part of a table a subscriber holds: the rows where `where` holds (the DBA's text,
    not yet checked), the `columns` listed; None: all of them."""

    where: str | None = None
    columns: list[str] | None = None

    @property
    def given(self) -> bool:
        return self.where is not None or self.columns is not None


EVERYTHING = Subset()


def refuse_unusable(node: nodes.Node, tables: list[str], formats: dict[str, str]) -> None:
    """Filters and column lists are for a leaf, on tables whose events carry whole rows.

    A branch carries every event on to its subscribers and may become the root or the copy
    source of nodes below it: it holds whole tables.  A merge-leaf's tables feed a combined
    queue whose subscribers expect the rows the events describe.  The seed's partial-SQL events
    cannot be filtered (an UPDATE names no row image to judge)."""
    if node.node_type is not nodes.NodeType.LEAF or node.combined_queue:
        kind = "a merge-leaf" if node.combined_queue else f"a {node.node_type.value}"
        raise UserError(
            f"--where/--columns are for a leaf, and {node.node_name} is {kind}: it passes whole rows on;"
            " filter on the leaves below it"
        )
    if len(tables) != 1:
        raise UserError("--where/--columns apply to exactly one table: add each table on its own")
    if formats.get(tables[0]) == "sql":
        raise UserError(
            f"--where/--columns need json events, and the root captures {tables[0]} in the seed's partial-SQL"
            " format (add-table --format=sql there)"
        )


def refuse_change(row_filter: str | None, column_list: list[str] | None, table: str, subset: Subset) -> None:
    """A table replicated here already keeps the filter and columns it was added with."""
    if subset.given:
        now = f"where {row_filter}" if row_filter else "every row"
        now += f", columns {', '.join(column_list)}" if column_list else ", every column"
        raise UserError(
            f"{table} is replicated here already ({now}): to change its filter or columns,"
            " remove-table it, then add-table it again (it is copied again)"
        )


def parse_columns(text: str) -> list[str]:
    """--columns a,b,c -> the names, as --key takes them (literal column names)."""
    names = [c.strip() for c in text.split(",")]
    if not all(names):
        raise UserError(f"--columns {text!r}: an empty column name")
    if len(set(names)) != len(names):
        raise UserError(f"--columns {text!r}: a column is named twice")
    return names


def check_columns(table: str, columns: list[str], prov_cols: list[catalog.Column], keys: list[str]) -> None:
    """The listed columns exist on the provider, are not generated, and hold the whole key."""
    known = {c.name: c for c in prov_cols}
    for c in columns:
        if c not in known:
            raise UserError(f"--columns: the provider's {table} has no column {c!r}")
        if known[c].generated:
            raise UserError(f"--columns: {c!r} of {table} is generated: the subscriber computes its own")
    missing = [k for k in keys if k not in columns]
    if missing:
        raise UserError(
            f"--columns must include the key of {table} ({', '.join(keys)}): {', '.join(missing)} missing"
        )


def canonical(sub: psycopg.Connection, dest: str, predicate: str) -> str:
    """The predicate as the subscriber's server deparses it (see the module doc), or a one-line
    refusal that says why."""
    if not predicate.strip():
        raise UserError("--where needs a predicate")
    try:
        with sub.transaction(force_rollback=True):
            sub.execute(sql.SQL("create temp table pgcascade_filter_check (like {})").format(sql.SQL(dest)))
            # a newline before the closing parenthesis: a trailing -- comment stays a comment
            check = sql.SQL("alter table {} add constraint pgcascade_filter check ({}\n)").format(
                sql.SQL(SCRATCH), sql.SQL(predicate)
            )
            sub.execute(check.as_bytes(sub), prepare=True)  # extended protocol: one statement only
            sub.execute("set local search_path = pg_catalog, pg_temp")
            expr = sub.execute(
                "select pg_get_expr(conbin, conrelid) from pg_constraint"
                " where conrelid = %s::regclass and conname = 'pgcascade_filter'",
                (SCRATCH,),
            ).fetchone()
            if expr is None or not expr[0]:
                raise UserError(f"--where {predicate!r}: not a boolean expression over {dest}'s columns")
            sub.execute(sql.SQL("create index on {} (({}))").format(sql.SQL(SCRATCH), sql.SQL(expr[0])))
            return str(expr[0])
    except psycopg.Error as e:
        raise UserError(f"--where {predicate!r} does not work on {dest}: {reason(e)}") from None


def reason(e: psycopg.Error) -> str:
    """The server's refusal in the words of a filter (the scratch table is an implementation detail)."""
    line = db_error_line(e)
    return (
        line.replace("in index expression", "in a filter")
        .replace("in check constraint", "in a filter")
        .replace("argument of CHECK", "a filter")
    )


def check_on_provider(prov: psycopg.Connection, table: str, expr: str) -> None:
    """The canonical filter must run on the provider's table too (the copy and compare read it)."""
    try:
        with prov.transaction(force_rollback=True):
            prov.execute(sql.SQL("select 1 from {} where ({}) limit 0").format(sql.SQL(table), sql.SQL(expr)))
    except psycopg.Error as e:
        raise UserError(f"--where {expr} does not work on the provider's {table}: {reason(e)}") from None


def embedded(expr: str, with_params: bool = False) -> sql.Composable:
    """A stored filter as SQL to embed, in parentheses.  `with_params`: the statement is run
    with parameters, where psycopg reads every % as a placeholder (a LIKE pattern has them)."""
    return sql.SQL("({})").format(sql.SQL(expr.replace("%", "%%") if with_params else expr))
