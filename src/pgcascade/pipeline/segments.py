"""Key ranges of a table and the SQL that hashes, lists and fetches the rows of one range.

Everything here runs inside PostgreSQL, next to the data, on both sides with the same text:

- A row's canonical text is `row(e1, e2, ...)::text` where each e is the column normalised so
  that equal values print alike (numeric through trim_scale: 1.0 = 1.00; json through jsonb).
  Record output quotes and escapes each field and prints NULL as nothing and '' as "", so the
  text is injective: NULL vs '', ('a,b', c) vs ('a', 'b,c') all differ.  The sessions fix
  DateStyle, TimeZone, IntervalStyle, extra_float_digits and bytea_output (SESSION_SETTINGS).
- A row's hash is hashtextextended(canonical text, 0): 64 bits.  A range's checksum is the
  count and the xor of those hashes, per bucket of the key's own hash: one scan of a range gives
  both the range's checksum and its split into `buckets` sub-ranges, so a differing range is
  narrowed to its differing buckets without another round trip.
- A key is carried as an array of the key columns' normalised texts; range bounds are such
  arrays, cast back to the key's types for row comparisons that use the primary key's index.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from pgcascade import catalog
from pgcascade.errors import UserError

# the same text for the same value on both sides, whatever each server's defaults
SESSION_SETTINGS = (
    "set datestyle = 'ISO, YMD'; set timezone = 'UTC'; set intervalstyle = 'postgres';"
    " set extra_float_digits = 3; set bytea_output = 'hex'; set lc_monetary = 'C'"
)


@dataclass(frozen=True)
class TableSpec:
    """One table as compared: the provider's name, the subscriber's, key and compared columns."""

    index: int
    table: str  # provider canonical name
    dest: str  # subscriber canonical name
    keys: tuple[str, ...]
    key_types: tuple[str, ...]
    columns: tuple[str, ...]
    types: tuple[str, ...]
    partitioned_prov: bool = False
    partitioned_sub: bool = False

    def relation(self, side: str) -> sql.Composable:
        part = self.partitioned_prov if side == "prov" else self.partitioned_sub
        name = sql.SQL(self.table if side == "prov" else self.dest)
        return name if part else sql.SQL("only {}").format(name)


def table_spec(
    index: int, prov: psycopg.Connection, sub: psycopg.Connection, table: str, dest: str, keys: list[str]
) -> TableSpec:
    """The columns both sides have (generated ones excepted); a column missing on one side is an error."""
    pcols = [c for c in catalog.columns(prov, table) if not c.generated]
    scols = {c.name: c for c in catalog.columns(sub, dest) if not c.generated}
    missing = [c.name for c in pcols if c.name not in scols]
    if missing:
        raise UserError(f"{dest} has no column {missing[0]!r} that the provider's {table} has")
    types = {c.name: c.type for c in pcols}
    return TableSpec(
        index=index,
        table=table,
        dest=dest,
        keys=tuple(keys),
        key_types=tuple(types[k] for k in keys),
        columns=tuple(c.name for c in pcols),
        types=tuple(c.type for c in pcols),
        partitioned_prov=catalog.is_partitioned(prov, table),
        partitioned_sub=catalog.is_partitioned(sub, dest),
    )


def normalised(column: str, type_: str) -> sql.Composable:
    """A column as its value's canonical form (equal values -> equal text)."""
    col = sql.Identifier(column)
    if type_.startswith("numeric"):
        return sql.SQL("trim_scale({})").format(col)
    if type_ == "json":
        return sql.SQL("{}::jsonb").format(col)
    return col


def key_array(spec: TableSpec) -> sql.Composable:
    return sql.SQL("array[{}]").format(
        sql.SQL(", ").join(
            sql.SQL("{}::text").format(normalised(k, t))
            for k, t in zip(spec.keys, spec.key_types, strict=True)
        )
    )


def row_hash(spec: TableSpec) -> sql.Composable:
    fields = sql.SQL(", ").join(normalised(c, t) for c, t in zip(spec.columns, spec.types, strict=True))
    return sql.SQL("hashtextextended(row({})::text, 0)").format(fields)


def bucket(spec: TableSpec, buckets: int) -> sql.Composable:
    """The key's bucket: a hash of the key's normalised text (one column: its text alone, cheaper)."""
    if len(spec.keys) == 1 and spec.key_types[0] in ("smallint", "integer", "bigint"):
        # an integer key: its own hash (cast to int8, so int4 and int8 sides agree), no text
        return sql.SQL("(hashint8extended({}::int8, 7) & {})").format(
            sql.Identifier(spec.keys[0]), sql.Literal(buckets - 1)
        )
    if len(spec.keys) == 1:
        key = sql.SQL("{}::text").format(normalised(spec.keys[0], spec.key_types[0]))
    else:
        key = sql.SQL("{}::text").format(key_array(spec))
    return sql.SQL("(hashtextextended({}, 7) & {})").format(key, sql.Literal(buckets - 1))


def _key_tuple(spec: TableSpec) -> sql.Composable:
    return sql.SQL("({})").format(sql.SQL(", ").join(map(sql.Identifier, spec.keys)))


def _bound(spec: TableSpec, values: list[str]) -> sql.Composable:
    return sql.SQL("({})").format(
        sql.SQL(", ").join(
            sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(t))
            for v, t in zip(values, spec.key_types, strict=True)
        )
    )


def key_range(spec: TableSpec, lo: list[str] | None, hi: list[str] | None) -> sql.Composable:
    """lo <= key < hi as a row comparison (the primary key's index serves it); None = open."""
    parts: list[sql.Composable] = []
    if lo is not None:
        parts.append(sql.SQL("{} >= {}").format(_key_tuple(spec), _bound(spec, lo)))
    if hi is not None:
        parts.append(sql.SQL("{} < {}").format(_key_tuple(spec), _bound(spec, hi)))
    return sql.SQL(" and ").join(parts) if parts else sql.SQL("true")


def bucket_checksums_sql(spec: TableSpec, side: str, lo, hi, buckets: int) -> sql.Composable:
    """(bucket, rows, xor of row hashes) of one key range.  xor, not sum: int8 aggregation is
    cheaper than numeric, and keys are unique, so no two equal rows cancel out."""
    return sql.SQL(
        "select b, count(*), bit_xor(h) from (select {} as b, {} as h from {} where {}) s group by b"
    ).format(bucket(spec, buckets), row_hash(spec), spec.relation(side), key_range(spec, lo, hi))


def row_hashes_sql(spec: TableSpec, side: str, lo, hi, buckets: int, which: list[int]) -> sql.Composable:
    """(key, row hash) of the rows of a key range that fall in the buckets `which`."""
    return sql.SQL("select {}, {} from {} where {} and {} = any({})").format(
        key_array(spec),
        row_hash(spec),
        spec.relation(side),
        key_range(spec, lo, hi),
        bucket(spec, buckets),
        sql.Literal(which),
    )


def fetch_rows_sql(spec: TableSpec, side: str) -> sql.Composable:
    """(key, every column as text) of the rows whose keys are given as one text array per key column."""
    match = sql.SQL("select {} from unnest({}) u({})").format(
        sql.SQL(", ").join(
            sql.SQL("u.{}::{}").format(sql.Identifier(f"k{i}"), sql.SQL(t))
            for i, t in enumerate(spec.key_types)
        ),
        sql.SQL(", ").join(sql.SQL("%s::text[]") for _ in spec.keys),
        sql.SQL(", ").join(sql.Identifier(f"k{i}") for i in range(len(spec.keys))),
    )
    values = sql.SQL("array[{}]").format(
        sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c in spec.columns)
    )
    return sql.SQL("select {}, {} from {} where {} in ({})").format(
        key_array(spec), values, spec.relation(side), _key_tuple(spec), match
    )


def split_points(
    conn: psycopg.Connection, spec: TableSpec, target_rows: int, max_segments: int
) -> list[list[str]]:
    """Key values that cut the provider's table into ranges of about target_rows: read from a
    block sample of its keys, sorted by the server (its collation), so no full scan is needed.
    The sample takes ~20 blocks per range: rows of one block have neighbouring keys, so a
    handful of blocks would cut the key space unevenly."""
    est, pages = conn.execute(
        "select reltuples::int8, relpages::int8 from pg_class where oid = %s::regclass", (spec.table,)
    ).fetchone()
    if est is None or est < 0:  # never analysed: count once
        est = conn.execute(sql.SQL("select count(*) from {}").format(spec.relation("prov"))).fetchone()[0]
    nseg = min(max_segments, max(1, -(-est // target_rows)))
    if nseg <= 1:
        return []
    if pages and pages > 0:
        pct = min(100.0, 100.0 * nseg * 20 / pages)
    else:  # partitioned (no pages of its own) or never analysed
        pct = min(100.0, 100.0 * nseg * 1000 / max(est, 1))
    keys = [
        r[0]
        for r in conn.execute(
            sql.SQL("select {} from {} tablesample system ({}) order by {}").format(
                key_array(spec),
                spec.relation("prov"),
                sql.Literal(pct),
                sql.SQL(", ").join(map(sql.Identifier, spec.keys)),
            )
        )
    ]
    if len(keys) < nseg:
        return []
    step = len(keys) / nseg
    cuts = [keys[int(i * step)] for i in range(1, nseg)]
    return [c for i, c in enumerate(cuts) if i == 0 or c != cuts[i - 1]]


def buckets_for(rows: int, leaf_rows: int) -> int:
    """A power of two that leaves about leaf_rows rows per bucket (64 .. 65536)."""
    b = 64
    while b < 65536 and rows / b > leaf_rows:
        b *= 2
    return b
