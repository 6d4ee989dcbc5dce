"""Compare a subscriber's tables with its provider's, in Spark, under a sync point's snapshots.

One Spark job, a DataFrame -> DataFrame function (the SQL it runs is in segments.py):

    compare_ranges   one task per key range, on both sides at once: rows and xor of row hashes
                     per bucket, computed by PostgreSQL in one scan of the range; then, only if
                     buckets differ, (key, row hash) of the rows of those buckets, diffed by key
                     (missing: provider only, extra: subscriber only, different: hashes differ),
                     and the provider's values of missing and different rows fetched by key

A range is split into buckets (~32 rows) in the same scan that checksums it: one bisection
step of many ways at no extra scan, so 0.1 % of rows differing spread over the whole table
costs one checksum pass plus reading the ~3 % of rows in differing buckets (through the key's
index when the key is an integer), where halving bisection would rescan every range log2(n)
times.  A task keeps its two connections and snapshots from the checksum to the fetch, and the
driver sees one summary per range and the differing rows, streamed (toLocalIterator) to the
report and the repair writer.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import psycopg
from psycopg import sql

from pgcascade.core import catalog, pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import one, scalar
from pgcascade.pgq import node as nodes
from pgcascade.pipeline import segments as sg
from pgcascade.pipeline.consistency import DEFAULT_SYNC_TIMEOUT, SyncPoint, sync_point
from pgcascade.replica import tables as subscriber

T = TypeVar("T")
log = logging.getLogger("pgcascade.pipeline")

SIDES = ("prov", "sub")
FETCH_CHUNK = 1000  # keys per fetch query
SAMPLE_KEYS = 5  # differing keys shown per table and kind
PROGRESS_EVERY = 2.0  # seconds between progress lines


@dataclass(frozen=True)
class Segment:
    sid: int
    tidx: int
    lo: list[str] | None
    hi: list[str] | None
    buckets: sg.Buckets


@dataclass(frozen=True)
class TaskContext:
    """What a Spark task needs to read both sides as of the sync point (pickled into tasks)."""

    prov_dsn: str
    sub_dsn: str
    prov_snapshot: str
    sub_snapshot: str
    specs: tuple[sg.TableSpec, ...]

    def dsn(self, side: str) -> str:
        return self.prov_dsn if side == "prov" else self.sub_dsn

    def snapshot(self, side: str) -> str:
        return self.prov_snapshot if side == "prov" else self.sub_snapshot


def open_side(ctx: TaskContext, side: str) -> psycopg.Connection:
    """A connection inside the sync point's snapshot of one side, with the canonical settings."""
    conn = pgconn.connect(ctx.dsn(side), autocommit=True, connect_timeout=10)
    conn.execute("set application_name = 'pgcascade compare task'")
    conn.execute(sg.SESSION_SETTINGS)
    # bucket checksums: hash aggregation (the planner misjudges the groups and sorts otherwise);
    # Spark runs the ranges in parallel, and a range's query is too short to repay JIT
    conn.execute("set enable_sort = off; set max_parallel_workers_per_gather = 0; set jit = off")
    conn.autocommit = False
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    conn.execute(sql.SQL("set transaction snapshot {}").format(sql.Literal(ctx.snapshot(side))))
    return conn


class BothSides:
    """A connection to each side inside its snapshot; both() runs a function on the two at once
    (each waits on its own server)."""

    def __init__(self, ctx: TaskContext):
        self.pool = ThreadPoolExecutor(2)
        self.conns: dict[str, psycopg.Connection] = {}
        try:
            for side, f in [(side, self.pool.submit(open_side, ctx, side)) for side in SIDES]:
                self.conns[side] = f.result()
        except BaseException:
            self.close()
            raise

    def both(self, fn: Callable[[psycopg.Connection, str], T]) -> dict[str, T]:
        futures = {side: self.pool.submit(fn, conn, side) for side, conn in self.conns.items()}
        return {side: f.result() for side, f in futures.items()}

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.pool.shutdown()

    def __enter__(self) -> BothSides:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- the Spark job ----------------------------------------------------------------------------

# one summary row per range (kind null: the range's row counts), then its differing rows
RESULT_SCHEMA = "tidx int, prows long, srows long, kind string, key array<string>, vals array<string>"


def diff_keys(prov: dict, sub: dict) -> Iterator[tuple[tuple, str]]:
    """(key, kind) of every key whose row differs between the two sides' {key: row hash}."""
    for k, h in prov.items():
        other = sub.get(k)
        if other is None:
            yield k, "missing"
        elif other != h:
            yield k, "different"
    for k in sub.keys() - prov.keys():
        yield k, "extra"


def compare_range(ctx: TaskContext, seg: Segment) -> Iterator[dict]:
    """The summary of one key range, then its differing rows: extra ones by key, missing and
    different ones with the provider's values (as text).  Holds at most the (key, hash) of the
    range's differing buckets (~bucket_rows each)."""
    spec = ctx.specs[seg.tidx]
    with BothSides(ctx) as sides:

        def sums(conn, side):
            q = sg.bucket_checksums_sql(spec, side, seg.lo, seg.hi, seg.buckets)
            return {b: (n, s) for b, n, s in conn.execute(q)}

        res = sides.both(sums)
        p, s = res["prov"], res["sub"]
        yield {
            "tidx": seg.tidx,
            "prows": sum(n for n, _ in p.values()),
            "srows": sum(n for n, _ in s.values()),
        }
        which = sorted(b for b in p.keys() | s.keys() if p.get(b) != s.get(b))
        del p, s, res
        if not which:
            return

        def hashes(conn, side):
            q = sg.row_hashes_sql(spec, side, seg.lo, seg.hi, seg.buckets)
            return {tuple(k): h for k, h in conn.execute(q, (which,))}

        res = sides.both(hashes)
        diffs = dict(diff_keys(res["prov"], res["sub"]))
        del res
        for k, v in diffs.items():
            if v == "extra":
                yield {"tidx": seg.tidx, "kind": "extra", "key": list(k)}
        wanted = [k for k, v in diffs.items() if v != "extra"]
        prov = sides.conns["prov"]
        for start in range(0, len(wanted), FETCH_CHUNK):
            chunk = wanted[start : start + FETCH_CHUNK]
            params = [list(col) for col in zip(*chunk, strict=True)]
            for k, v in prov.execute(sg.fetch_rows_sql(spec, "prov"), params):
                yield {"tidx": seg.tidx, "kind": diffs[tuple(k)], "key": k, "vals": v}


def compare_ranges(spark, ctx: TaskContext, segs: list[Segment]):
    """-> DataFrame(RESULT_SCHEMA): one task per key range (compare_range)."""

    def task(batches):
        import pyarrow as pa

        schema = _arrow_schema(RESULT_SCHEMA)
        for b in batches:
            for i in b.column(0).to_pylist():
                rows = compare_range(ctx, segs[i])
                while chunk := list(itertools.islice(rows, FETCH_CHUNK)):
                    yield pa.RecordBatch.from_pylist(chunk, schema=schema)

    return spark.range(0, len(segs), 1, max(len(segs), 1)).mapInArrow(task, RESULT_SCHEMA)


def _arrow_schema(ddl: str):
    """The pyarrow schema of one of the DDL strings above (they use int, long, string, arrays)."""
    import pyarrow as pa

    types = {"int": pa.int32(), "long": pa.int64(), "string": pa.string()}
    fields = []
    for part in ddl.split(", "):
        name, typ = part.split(" ", 1)
        if typ.startswith("array<"):
            fields.append(pa.field(name, pa.list_(types[typ[6:-1]])))
        else:
            fields.append(pa.field(name, types[typ]))
    return pa.schema(fields)


# --- the driver -------------------------------------------------------------------------------


@dataclass
class TableResult:
    spec: sg.TableSpec
    rows: int = 0  # provider rows
    sub_rows: int = 0
    missing: int = 0
    extra: int = 0
    different: int = 0
    samples: dict[str, list[list[str]]] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return self.missing == self.extra == self.different == 0 and self.rows == self.sub_rows


@dataclass
class Settings:
    segment_rows: int = 250_000  # rows per key range (one Spark task each)
    bucket_rows: int = 32  # rows per key-hash bucket of a range
    max_segments: int = 4096
    sync_timeout: float = DEFAULT_SYNC_TIMEOUT

    @classmethod
    def from_config(cls, cfg: JobConfig) -> Settings:
        s = cfg.pipeline
        return cls(s.compare_segment_rows, s.compare_bucket_rows, s.compare_max_segments, s.sync_timeout)


def chosen_tables(sub: psycopg.Connection, queue: str, names: list[str]) -> list[subscriber.SubscriberTable]:
    """The named tables (provider or local names), or every replicated table; all must be ok."""
    nodes.require_node(sub, queue)
    replicated = subscriber.tables(sub, queue)
    if names:
        wanted = [catalog.canonical(sub, n) for n in names]
        picked = []
        for name, want in zip(names, wanted, strict=True):
            t = next((t for t in replicated if want in (t.table_name, t.dest_table)), None)
            if t is None:
                raise UserError(f"table {name!r} is not replicated here")
            picked.append(t)
    else:
        picked = replicated
    if not picked:
        raise UserError("no tables are replicated here: nothing to compare")
    not_ok = [f"{t.table_name} ({t.state})" for t in picked if not t.state.is_ok]
    if not_ok:
        raise UserError(f"tables not in sync yet (state is not ok): {', '.join(not_ok)}")
    return picked


class Progress:
    """Phases and timings on stderr (rich), quiet when stderr is not a terminal unless asked."""

    def __init__(self, enabled: bool = True):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled
        self.started = time.monotonic()

    def step(self, message: str) -> None:
        if self.enabled:
            self.console.print(
                f"[dim]{time.monotonic() - self.started:6.1f}s[/dim] {message}", highlight=False
            )


class Comparison:
    """One compare run: sync point, Spark jobs, results.  Use as a context manager: the
    snapshots stay exported until it closes."""

    def __init__(self, cfg: JobConfig, names: list[str], progress: Progress | None = None):
        if not cfg.db or not cfg.queue_name:
            raise UserError(f"{cfg.path}: db and queue_name must be set")
        self.cfg = cfg
        self.db: str = cfg.db
        self.queue: str = cfg.queue_name
        self.settings = Settings.from_config(cfg)
        self.progress = progress or Progress(False)
        with pgconn.connect(cfg.db, autocommit=True, connect_timeout=10) as sub:
            self.tables = chosen_tables(sub, self.queue, names)
        self.point: SyncPoint | None = None
        self.ctx: TaskContext | None = None

    @property
    def sync(self) -> SyncPoint:
        assert self.point is not None, "used outside `with Comparison(...)`"
        return self.point

    @property
    def task(self) -> TaskContext:
        assert self.ctx is not None, "used outside `with Comparison(...)`"
        return self.ctx

    def __enter__(self) -> Comparison:
        self.progress.step(
            f"sync point: locking {len(self.tables)} provider table(s), waiting for the subscriber"
        )
        self.point = sync_point(self.db, self.queue, self.tables, self.settings.sync_timeout)
        self.progress.step(
            f"sync point at tick {self.sync.tick} (provider locked {self.sync.locked_for:.2f} s)"
        )
        with (
            pgconn.connect(self.sync.prov_dsn, autocommit=True) as prov,
            pgconn.connect(self.sync.sub_dsn, autocommit=True) as sub,
        ):
            specs = tuple(
                sg.table_spec(
                    i, prov, sub, t.table_name, t.dest_table, t.key_columns, t.row_filter, t.column_list
                )
                for i, t in enumerate(self.tables)
            )
        self.ctx = TaskContext(
            self.sync.prov_dsn, self.sync.sub_dsn, self.sync.prov_snapshot, self.sync.sub_snapshot, specs
        )
        return self

    def __exit__(self, *exc) -> None:
        if self.point is not None:
            self.sync.close()

    def count_only(self) -> list[TableResult]:
        """The seed's cheap check: count(*) on both sides, under the snapshots."""
        out = []
        holders = dict(zip(SIDES, self.sync.holders, strict=True))
        for spec in self.task.specs:
            r = TableResult(spec)
            r.rows, r.sub_rows = (
                scalar(holders[side], sql.SQL("select count(*) from {}").format(spec.relation(side)))
                for side in SIDES
            )
            out.append(r)
            self.progress.step(f"{spec.table}: {r.rows} rows on the provider, {r.sub_rows} on the subscriber")
        return out

    def plan(self) -> list[Segment]:
        st = self.settings
        segs: list[Segment] = []
        with BothSides(self.task) as sides:
            prov = sides.conns["prov"]
            for spec in self.task.specs:
                cuts = sg.split_points(prov, spec, st.segment_rows, st.max_segments)
                bounds = [None, *cuts, None]
                per = st.segment_rows if cuts else None
                if per is None:  # one range: size its buckets by the table's estimate
                    per = max(
                        scalar(
                            prov,
                            "select reltuples::int8 from pg_class where oid = %s::regclass",
                            (spec.table,),
                        ),
                        1,
                    )
                count = sg.buckets_for(per, st.bucket_rows)
                ends = integer_key_ends(sides, spec)
                for lo, hi in itertools.pairwise(bounds):
                    segs.append(Segment(len(segs), spec.index, lo, hi, range_buckets(count, lo, hi, ends)))
        return segs

    def run(self, spark, on_row: Callable[[TableResult, dict], None] | None = None) -> list[TableResult]:
        """Compare every table; on_row(result, row) receives each differing row as it streams in."""
        results = [TableResult(spec) for spec in self.task.specs]
        segs = self.plan()
        self.progress.step(f"checksums of {len(segs)} key range(s) of {len(results)} table(s) on both sides")
        done, last = 0, time.monotonic()
        for row in compare_ranges(spark, self.task, segs).toLocalIterator(prefetchPartitions=True):
            res = results[row["tidx"]]
            kind = row["kind"]
            if kind is None:  # a range's summary
                res.rows += row["prows"]
                res.sub_rows += row["srows"]
                done += 1
                if time.monotonic() - last >= PROGRESS_EVERY or done == len(segs):
                    last = time.monotonic()
                    self.progress.step(
                        f"{done}/{len(segs)} range(s) compared, {self.differing(results)} row(s) differ"
                    )
                continue
            setattr(res, kind, getattr(res, kind) + 1)
            samples = res.samples.setdefault(kind, [])
            if len(samples) < SAMPLE_KEYS:
                samples.append(list(row["key"]))
            if on_row is not None:
                on_row(res, row.asDict())
        self.progress.step("done")
        return results

    @staticmethod
    def differing(results: list[TableResult]) -> int:
        return sum(r.missing + r.extra + r.different for r in results)


def integer_key_ends(sides: BothSides, spec: sg.TableSpec) -> tuple[int, int] | None:
    """The lowest and highest key of either side, for an integer key (its index answers)."""
    if not sg.integer_key(spec):
        return None
    k = sql.Identifier(spec.keys[0])
    got = sides.both(
        lambda conn, side: one(
            conn, sql.SQL("select min({})::int8, max({})::int8 from {}").format(k, k, spec.relation(side))
        )
    )
    lows = [lo for lo, _ in got.values() if lo is not None]
    highs = [hi for _, hi in got.values() if hi is not None]
    return (min(lows), max(highs) + 1) if lows else (0, 1)


def range_buckets(
    count: int, lo: list[str] | None, hi: list[str] | None, ends: tuple[int, int] | None
) -> sg.Buckets:
    """count buckets of consecutive keys over [lo, hi) when the key is an integer (an open end
    is the lowest or highest key of either side), else by key hash."""
    if ends is None:
        return sg.Buckets(count)
    base = int(lo[0]) if lo is not None else ends[0]
    end = int(hi[0]) if hi is not None else max(ends[1], base + 1)
    if end - base >= 1 << 62:  # key offsets would overflow int8 arithmetic
        return sg.Buckets(count)
    return sg.Buckets(count, base, max(1, -(-(end - base) // count)))
