"""Key ranges of a table and the SQL that hashes, lists and fetches the rows of one range.

Everything here runs inside PostgreSQL, next to the data, on both sides with the same text:

- A row's hash is a 64-bit mix of its columns' hashes.  Each column is hashed by its type's own
  extended hash function (the one hash indexes use, so equal values hash alike: 1.0 = 1.00,
  'a ' = 'a' in char(n), jsonb key order), with the column's position as the seed, so a value
  moved to another column changes the hash; NULL hashes to a per-column constant, never like ''.
  Types without a portable hash function (enums hash their OIDs, which differ between
  databases; arrays, dates, intervals, bytea, domains ...) are hashed through their canonical
  text.  The sessions fix DateStyle, TimeZone, IntervalStyle, extra_float_digits and
  bytea_output (SESSION_SETTINGS) so that text is the same on both sides.  Typed hashing costs
  about half of printing the row as text (pgbench_accounts: 64 vs 118 ms per 250k rows).
- A range's checksum is the count and the xor of its row hashes, per bucket: one scan of a
  range gives both the range's checksum and its split into buckets, so a differing range is
  narrowed to its differing buckets without another scan.  An integer key's buckets are
  consecutive key intervals (the differing ones are then read back through the key's index);
  other keys are bucketed by a hash of the key.
- A key is carried as an array of the key columns' normalised texts; range bounds are such
  arrays, cast back to the key's types for row comparisons that use the primary key's index.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from pgcascade.core import catalog
from pgcascade.core.copystream import OUTPUT_SETTINGS
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import one, scalar
from pgcascade.replica import filters

# the same text for the same value on both sides, whatever each server's defaults
SESSION_SETTINGS = OUTPUT_SETTINGS


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
    row_filter: str | None = None  # the subscriber holds the provider's rows that pass it

    def base(self, side: str) -> sql.Composable:
        """The side's table: with its partitions, or ONLY it (its children are not replicated)."""
        part = self.partitioned_prov if side == "prov" else self.partitioned_sub
        name = sql.SQL(self.table if side == "prov" else self.dest)
        return name if part else sql.SQL("only {}").format(name)

    def relation(self, side: str, with_params: bool = False) -> sql.Composable:
        """The rows compared on a side: the provider's that pass the subscriber's filter, every
        row of the subscriber's (one that fails it is extra).  `with_params`: for a statement
        run with parameters (filters.embedded)."""
        if side != "prov" or self.row_filter is None:
            return self.base(side)
        return sql.SQL("(select * from {} where {}) pgcascade_rows").format(
            self.base(side), filters.embedded(self.row_filter, with_params)
        )

    def filter_clause(self, side: str) -> sql.Composable:
        """`and FILTER` for the provider's side of a filtered table, else nothing."""
        if side != "prov" or self.row_filter is None:
            return sql.SQL("")
        return sql.SQL(" and {}").format(filters.embedded(self.row_filter))


def table_spec(
    index: int,
    prov: psycopg.Connection,
    sub: psycopg.Connection,
    table: str,
    dest: str,
    keys: list[str],
    row_filter: str | None = None,
    column_list: list[str] | None = None,
) -> TableSpec:
    """The columns both sides have (generated ones excepted; of the column list, if any); a
    column missing on one side is an error."""
    pcols = [
        c
        for c in catalog.columns(prov, table)
        if not c.generated and (column_list is None or c.name in column_list)
    ]
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
        row_filter=row_filter,
    )


def normalised(column: str, type_: str) -> sql.Composable:
    """A column as its value's canonical form (equal values -> equal text)."""
    col = sql.Identifier(column)
    if type_.startswith("numeric"):
        return sql.SQL("trim_scale({})").format(col)
    if type_ == "json":
        return sql.SQL("{}::jsonb").format(col)
    return col


def key_array(spec: TableSpec) -> sql.Composed:
    return sql.SQL("array[{}]").format(
        sql.SQL(", ").join(
            sql.SQL("{}::text").format(normalised(k, t))
            for k, t in zip(spec.keys, spec.key_types, strict=True)
        )
    )


INTEGER_TYPES = ("smallint", "integer", "bigint")

# type (format_type without its modifier) -> its hash function applied to a column of it
TYPED_HASHES = {
    "smallint": "hashint8extended({}::int8, {})",
    "integer": "hashint8extended({}::int8, {})",
    "bigint": "hashint8extended({}::int8, {})",
    "numeric": "hash_numeric_extended({}::numeric, {})",
    "text": 'hashtextextended({}::text collate "C", {})',
    "character varying": 'hashtextextended({}::text collate "C", {})',
    "character": 'hashbpcharextended({}::bpchar collate "C", {})',
    "uuid": "uuid_hash_extended({}::uuid, {})",
    "jsonb": "jsonb_hash_extended({}::jsonb, {})",
    "json": "jsonb_hash_extended({}::jsonb, {})",
    "boolean": "hashint4extended({}::int4, {})",
    "real": "hashfloat8extended({}::float8, {})",
    "double precision": "hashfloat8extended({}::float8, {})",
    "timestamp without time zone": "timestamp_hash_extended({}::timestamp, {})",
    "timestamp with time zone": "timestamp_hash_extended({}::timestamptz at time zone 'UTC', {})",
}


def _base_type(type_: str) -> str:
    """format_type's text without the modifier: 'character(84)' -> 'character',
    'timestamp(3) with time zone' -> 'timestamp with time zone'."""
    head, paren, rest = type_.partition("(")
    return head if not paren else (head + rest.partition(")")[2]).rstrip()


def column_hash(column: str, type_: str, seed: int) -> sql.Composed:
    """One column's 64-bit hash, seeded by its position; NULL -> a constant of that position."""
    template = TYPED_HASHES.get(_base_type(type_))
    col: sql.Composable = sql.Identifier(column)
    if template is None:  # no portable hash function: its canonical text
        template = 'hashtextextended({}::text collate "C", {})'
        col = normalised(column, type_)
    return sql.SQL("coalesce({}, {})").format(
        sql.SQL(template).format(col, sql.Literal(seed)), sql.Literal(-0x5BD1E995 * seed)
    )


def row_hash(spec: TableSpec) -> sql.Composed:
    """The row's hash: its columns' hashes xor-ed, then mixed once more, so that the xor of a
    bucket's row hashes does not cancel when values are swapped between two rows."""
    cols = sql.SQL(" # ").join(
        column_hash(c, t, i + 1) for i, (c, t) in enumerate(zip(spec.columns, spec.types, strict=True))
    )
    return sql.SQL("hashint8extended({}, 0)").format(cols)


def integer_key(spec: TableSpec) -> bool:
    return len(spec.keys) == 1 and spec.key_types[0] in INTEGER_TYPES


@dataclass(frozen=True)
class Buckets:
    """How a range is split into buckets: consecutive key intervals of `width` from `base` (an
    integer key), or `count` buckets by key hash (width None)."""

    count: int
    base: int = 0
    width: int | None = None


def bucket(spec: TableSpec, b: Buckets) -> sql.Composed:
    """The bucket number of a row's key."""
    if b.width is not None:  # every key of the range is >= base: the division floors
        return sql.SQL("(({}::int8 - {}) / {})").format(
            sql.Identifier(spec.keys[0]), sql.Literal(b.base), sql.Literal(b.width)
        )
    if len(spec.keys) == 1:
        key = sql.SQL('{}::text collate "C"').format(normalised(spec.keys[0], spec.key_types[0]))
    else:
        key = sql.SQL("{}::text").format(key_array(spec))
    return sql.SQL("(hashtextextended({}, 7) & {})").format(key, sql.Literal(b.count - 1))


def _key_tuple(spec: TableSpec) -> sql.Composed:
    return sql.SQL("({})").format(sql.SQL(", ").join(map(sql.Identifier, spec.keys)))


def _bound(spec: TableSpec, values: list[str]) -> sql.Composed:
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


def bucket_checksums_sql(spec: TableSpec, side: str, lo, hi, b: Buckets) -> sql.Composed:
    """(bucket, rows, xor of row hashes) of one key range.  xor, not sum: int8 aggregation is
    cheaper than numeric, and keys are unique, so no two equal rows cancel out."""
    return sql.SQL(
        "select b, count(*), bit_xor(h) from (select {} as b, {} as h from {} where {}) s group by b"
    ).format(bucket(spec, b), row_hash(spec), spec.relation(side), key_range(spec, lo, hi))


def row_hashes_sql(spec: TableSpec, side: str, lo, hi, b: Buckets) -> sql.Composed:
    """(key, row hash) of the rows of a key range in the buckets given as %s (an int8 array).
    Integer keys: one index range scan per bucket; hashed keys: the range again, filtered."""
    rel, rng = spec.relation(side, with_params=True), key_range(spec, lo, hi)
    if b.width is not None:
        k = sql.Identifier(spec.keys[0])
        return sql.SQL(
            "select {}, {} from unnest(%s::int8[]) w(pgcascade_bucket) join {}"
            " on {} >= {} + pgcascade_bucket * {} and {} < {} + (pgcascade_bucket + 1) * {} where {}"
        ).format(
            key_array(spec), row_hash(spec), rel, k, sql.Literal(b.base), sql.Literal(b.width),
            k, sql.Literal(b.base), sql.Literal(b.width), rng,
        )  # fmt: skip
    return sql.SQL("select {}, {} from {} where {} and {} in (select unnest(%s::int8[]))").format(
        key_array(spec), row_hash(spec), rel, rng, bucket(spec, b)
    )


def fetch_rows_sql(spec: TableSpec, side: str) -> sql.Composed:
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
        key_array(spec), values, spec.relation(side, with_params=True), _key_tuple(spec), match
    )


def split_points(
    conn: psycopg.Connection, spec: TableSpec, target_rows: int, max_segments: int
) -> list[list[str]]:
    """Key values that cut the provider's table into ranges of about target_rows: read from a
    block sample of its keys, sorted by the server (its collation), so no full scan is needed.
    The sample takes ~20 blocks per range: rows of one block have neighbouring keys, so a
    handful of blocks would cut the key space unevenly."""
    est, pages = one(
        conn, "select reltuples::int8, relpages::int8 from pg_class where oid = %s::regclass", (spec.table,)
    )
    if est is None or est < 0:  # never analysed: count once
        est = scalar(conn, sql.SQL("select count(*) from {}").format(spec.relation("prov")))
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
            sql.SQL("select {} from {} tablesample system ({}) where true{} order by {}").format(
                key_array(spec),
                spec.base("prov"),
                sql.Literal(pct),
                spec.filter_clause("prov"),
                sql.SQL(", ").join(map(sql.Identifier, spec.keys)),
            )
        )
    ]
    return cut_points(keys, nseg)


def cut_points(keys: list[list[str]], nseg: int) -> list[list[str]]:
    """From a sorted sample of keys, the nseg - 1 keys that cut it into nseg equal parts (a
    key repeated in the sample cuts once); none when the sample is smaller than nseg."""
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
