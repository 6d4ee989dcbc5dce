"""Indexes and constraints of a table, dropped around its initial copy and restored after.

A COPY into a table without indexes, then one index build, is several times faster than
keeping the indexes up to date row by row.  The definitions are read from the catalog before
they are dropped and travel with the copy (the Spark copy keeps them in its plan, so a copy
resumed after a crash restores them too).
"""

from __future__ import annotations

import json
import logging

import psycopg
from psycopg import sql

log = logging.getLogger("pgcascade.copy")


class SavedDefinitions:
    """Indexes and constraints of a table (and foreign keys pointing at it), dropped around COPY."""

    def __init__(self, constraints: list[tuple], indexes: list[tuple]):
        self.constraints = constraints  # (owner table, name, definition, contype)
        self.indexes = indexes  # (index name, CREATE INDEX statement)

    @classmethod
    def read(cls, conn: psycopg.Connection, table: str) -> SavedDefinitions:
        constraints = conn.execute(
            "select format('%%I.%%I', n.nspname, c.relname), con.conname, pg_get_constraintdef(con.oid), con.contype"
            " from pg_constraint con join pg_class c on c.oid = con.conrelid"
            " join pg_namespace n on n.oid = c.relnamespace"
            " where (con.conrelid = %s::regclass and con.contype in ('p', 'u', 'x', 'f'))"
            "    or (con.confrelid = %s::regclass and con.contype = 'f' and con.conrelid <> %s::regclass)"
            " order by con.contype = 'f' desc",
            (table, table, table),
        ).fetchall()
        indexes = conn.execute(
            "select format('%%I.%%I', n.nspname, ic.relname), pg_get_indexdef(i.indexrelid)"
            " from pg_index i join pg_class ic on ic.oid = i.indexrelid join pg_namespace n on n.oid = ic.relnamespace"
            " where i.indrelid = %s::regclass"
            " and not exists (select 1 from pg_constraint con where con.conindid = i.indexrelid)",
            (table,),
        ).fetchall()
        return cls(constraints, indexes)

    def to_json(self) -> str:
        return json.dumps(
            {"constraints": [list(c) for c in self.constraints], "indexes": [list(i) for i in self.indexes]}
        )

    @classmethod
    def from_json(cls, data: dict) -> SavedDefinitions:
        return cls([tuple(c) for c in data["constraints"]], [tuple(i) for i in data["indexes"]])

    def drop(self, conn: psycopg.Connection) -> None:
        for owner, name, _, _ in self.constraints:  # foreign keys first: they depend on the keys
            conn.execute(
                sql.SQL("alter table {} drop constraint {}").format(sql.SQL(owner), sql.Identifier(name))
            )
        for name, _ in self.indexes:
            conn.execute(sql.SQL("drop index {}").format(sql.SQL(name)))

    def restore(self, conn: psycopg.Connection) -> None:
        for _, ddl in self.indexes:
            conn.execute(ddl.encode())
        for owner, name, definition, contype in reversed(self.constraints):
            add = sql.SQL("alter table {} add constraint {} {}").format(
                sql.SQL(owner), sql.Identifier(name), sql.SQL(definition)
            )
            if contype != "f":
                conn.execute(add)
                continue
            # a foreign key may point at rows another table has not received yet: add it
            # NOT VALID (enforcement is off under replication anyway) and validate when it holds
            conn.execute(sql.SQL("{} not valid").format(add))
            try:
                with conn.transaction():
                    conn.execute(
                        sql.SQL("alter table {} validate constraint {}").format(
                            sql.SQL(owner), sql.Identifier(name)
                        )
                    )
            except psycopg.errors.ForeignKeyViolation:
                log.warning(
                    "foreign key %s on %s left NOT VALID: rows refer to rows not copied yet", name, owner
                )
