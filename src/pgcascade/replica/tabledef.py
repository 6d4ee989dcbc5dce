"""A table's whole definition, read from the provider's catalog and made on a subscriber
(`add-table --create-full`, Londiste 3's flag of the same name).

`--create` makes a table from the columns only; a node made that way cannot become the root
(no defaults, no sequences: the application's `insert ... (data)` fails after a takeover).
`--create-full` also makes the column defaults, identity and generated columns, the sequences
the defaults use (owned by their column, at the provider's value), unique, check and exclusion
constraints, indexes, and foreign keys once both ends exist here (those pointing at the new
table from tables already here are added too).  Not made: triggers (the provider's include its
capture triggers), rules, policies, grants, owners, comments and partitions (a partitioned
table is made as an ordinary table) - `pg_dump -s` is the tool for those.

The catalog is read with `search_path = pg_catalog`, so every name in an expression comes
out schema-qualified and means the same on the subscriber.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from pgcascade.core import catalog


@dataclass(frozen=True)
class SequenceDef:
    name: str  # canonical
    options: str  # as TYPE increment by ... cycle
    last_value: int
    is_called: bool
    owner_column: str | None  # owned by this column of the table (serial), or shared


@dataclass(frozen=True)
class Constraint:
    owner: str  # the table that has it (canonical)
    name: str
    definition: str  # pg_get_constraintdef
    contype: str  # p u c x f
    references: str | None  # a foreign key's referenced table (canonical)


@dataclass
class TableDefinition:
    table: str
    columns: list[str]  # column definitions, SQL
    sequences: list[SequenceDef]  # used by the column defaults
    identities: list[tuple[str, int, bool]]  # identity column, its sequence's last_value, is_called
    constraints: list[Constraint]  # of the table, foreign keys last
    incoming: list[Constraint]  # foreign keys of other tables that point at it
    indexes: list[str]  # CREATE INDEX statements of indexes no constraint owns

    @classmethod
    def read(cls, prov: psycopg.Connection, table: str) -> TableDefinition:
        with prov.transaction():
            prov.execute("set local search_path = pg_catalog")
            defaults = catalog.column_defaults(prov, table)
            return cls(
                table,
                read_columns(prov, table, defaults),
                read_sequences(prov, defaults),
                [
                    (d.name, *sequence_state(prov, d.sequence))
                    for d in defaults.values()
                    if d.identity and d.sequence
                ],
                read_constraints(prov, "con.conrelid = %s::regclass", table),
                read_constraints(
                    prov,
                    "con.confrelid = %s::regclass and con.conrelid <> con.confrelid and con.contype = 'f'",
                    table,
                ),
                [
                    r[0]
                    for r in prov.execute(
                        "select pg_get_indexdef(i.indexrelid) from pg_index i"
                        " where i.indrelid = %s::regclass"
                        " and not exists (select 1 from pg_constraint con where con.conindid = i.indexrelid)"
                        " order by i.indexrelid",
                        (table,),
                    )
                ],
            )

    def create(self, conn: psycopg.Connection, dest: str) -> list[str]:
        """Make the table as `dest` (with what it needs); returns notes on what was left out."""
        notes: list[str] = []
        sch, _ = catalog.split_name(conn, dest)
        conn.execute(sql.SQL("create schema if not exists {}").format(sql.Identifier(sch)))
        for s in self.sequences:
            if catalog.table_exists(conn, s.name):
                notes.append(f"sequence {s.name} exists here already: kept at its value")
                continue
            conn.execute(f"create sequence {s.name} {s.options}".encode())
            conn.execute("select setval(%s::regclass, %s, %s)", (s.name, s.last_value, s.is_called))
        conn.execute(f"create table {dest} ({', '.join(self.columns)})".encode())
        for s in self.sequences:
            if s.owner_column:
                conn.execute(
                    sql.SQL("alter sequence {} owned by {}.{}").format(
                        sql.SQL(s.name), sql.SQL(dest), sql.Identifier(s.owner_column)
                    )
                )
        for col, value, called in self.identities:
            conn.execute("select setval(pg_get_serial_sequence(%s, %s), %s, %s)", (dest, col, value, called))
        renamed = dest != self.table
        for c in self.constraints:
            if c.contype == "f" and (renamed or not catalog.table_exists(conn, c.references or "")):
                notes.append(f"foreign key {c.name} not made: {c.references} is not here (yet)")
                continue
            add_constraint(conn, dest, c)
        for c in self.incoming:
            if renamed or not catalog.table_exists(conn, c.owner):
                continue  # made with the other table, when it comes (its own foreign keys)
            add_constraint(conn, c.owner, c)
            notes.append(f"foreign key {c.name} of {c.owner} made, pointing at the new table")
        on_table = f" ON {self.table} USING "
        for ddl in self.indexes:
            conn.execute(ddl.replace(on_table, f" ON {dest} USING ", 1).encode())
        return notes


def add_constraint(conn: psycopg.Connection, owner: str, c: Constraint) -> None:
    """Foreign keys are added NOT VALID: the other end may hold rows not copied yet (the copy
    validates them once it has the rows; replication does not enforce them either way)."""
    add = sql.SQL("alter table {} add constraint {} {}").format(
        sql.SQL(owner), sql.Identifier(c.name), sql.SQL(c.definition)
    )
    if c.contype == "f" and not c.definition.endswith("NOT VALID"):
        add = sql.SQL("{} not valid").format(add)
    conn.execute(add)


def read_columns(
    prov: psycopg.Connection, table: str, defaults: dict[str, catalog.ColumnDefault]
) -> list[str]:
    rows = prov.execute(
        "select a.attname, quote_ident(a.attname), format_type(a.atttypid, a.atttypmod),"
        " case when a.attcollation <> t.typcollation then format(' collate %%I.%%I', cn.nspname, co.collname) else '' end,"
        " a.attidentity, a.attgenerated, pg_get_expr(d.adbin, d.adrelid), a.attnotnull"
        " from pg_attribute a join pg_type t on t.oid = a.atttypid"
        " left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum"
        " left join pg_collation co on co.oid = a.attcollation"
        " left join pg_namespace cn on cn.oid = co.collnamespace"
        " where a.attrelid = %s::regclass and a.attnum > 0 and not a.attisdropped order by a.attnum",
        (table,),
    ).fetchall()
    out = []
    for attname, name, typ, collate, identity, generated, default, not_null in rows:
        col = f"{name} {typ}{collate}"
        if generated:
            col += f" generated always as ({default}) stored"
        elif identity:
            kind = "always" if identity == "a" else "by default"
            seq = defaults[attname].sequence
            assert seq is not None
            col += f" generated {kind} as identity ({sequence_options(prov, seq, False)})"
        elif default is not None:
            col += f" default {default}"
        out.append(col + (" not null" if not_null else ""))
    return out


def sequence_options(prov: psycopg.Connection, seq: str, with_type: bool = True) -> str:
    """CREATE SEQUENCE options; an identity column's sequence takes its type from the column."""
    row = prov.execute(
        "select format_type(seqtypid, null), seqincrement, seqmin, seqmax, seqstart, seqcache, seqcycle"
        " from pg_sequence where seqrelid = %s::regclass",
        (seq,),
    ).fetchone()
    assert row is not None
    typ, inc, lo, hi, start, cache, cycle = row
    return (
        (f"as {typ} " if with_type else "")
        + f"increment by {inc} minvalue {lo} maxvalue {hi} start with {start} cache {cache}"
        f" {'cycle' if cycle else 'no cycle'}"
    )


def read_sequences(prov: psycopg.Connection, defaults: dict[str, catalog.ColumnDefault]) -> list[SequenceDef]:
    """Sequences the column defaults use (not identity columns': those come with the column)."""
    out: dict[str, SequenceDef] = {}
    for d in defaults.values():
        if d.sequence and not d.identity and d.sequence not in out:
            last, called = sequence_state(prov, d.sequence)
            owner = d.name if d.owned else None
            out[d.sequence] = SequenceDef(d.sequence, sequence_options(prov, d.sequence), last, called, owner)
    return sorted(out.values(), key=lambda s: s.name)


def sequence_state(prov: psycopg.Connection, seq: str) -> tuple[int, bool]:
    """(last_value, is_called): what setval() takes to put a copy at the same place."""
    row = prov.execute(f"select last_value, is_called from {seq}".encode()).fetchone()
    assert row is not None
    return row[0], row[1]


def read_constraints(prov: psycopg.Connection, where: str, table: str) -> list[Constraint]:
    return [
        Constraint(*r)
        for r in prov.execute(
            "select format('%%I.%%I', n.nspname, c.relname), con.conname, pg_get_constraintdef(con.oid),"
            " con.contype::text,"
            " case when con.contype = 'f' then con.confrelid::regclass::text end"
            " from pg_constraint con join pg_class c on c.oid = con.conrelid"
            " join pg_namespace n on n.oid = c.relnamespace"
            f" where {where} and con.contype in ('p', 'u', 'c', 'x', 'f')"
            " order by con.contype = 'f', con.conname",
            (table,),
        ).fetchall()
    ]
