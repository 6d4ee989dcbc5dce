"""A staged batch's set-based apply (replica/apply.py, applysql.py): one MERGE per table on
PostgreSQL 15+, INSERT, UPDATE and DELETE in CTEs before (and where the server refuses a
MERGE).  What a user checks: after a batch of inserts, updates and deletes - keys changed many
times, deleted and inserted again, rows the subscriber lost or already holds - the subscriber
holds the rows the provider's events say, for every shape of destination: a key alone, an
identity key, no unique index, partitions a row moves between, a row filter rows move in and
out of, a column list, a rule - and a batch of inserts alone, one plain INSERT unless a key is
here already.  The expected rows come from a model of the events in Python, not from the code
under test.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field

import pytest

from pgcascade.replica.apply import TableApplier, apply_staged
from pgcascade.replica.stage import STAGE_TABLE, ensure_stage
from pgcascade.replica.state import TableState
from pgcascade.replica.tables import SubscriberTable

PLAIN = "create table t (id int primary key, v int, w text)"


@dataclass
class Shape:
    provider: str
    subscriber: list[str]
    row_filter: str | None = None
    column_list: list[str] | None = None
    key: list[str] = field(default_factory=lambda: ["id"])
    # the subscriber lost rows that are updated, and holds one that is inserted: the set-based
    # statements write them; row by row (a table with rules) an insert of a held row is an error
    drift: bool = True

    @property
    def key_only(self) -> bool:
        return self.key == ["id", "w"]


SHAPES = {
    "plain": Shape(PLAIN, [PLAIN]),
    "key-only": Shape(
        "create table t (id int, w text, primary key (id, w))",
        ["create table t (id int, w text, primary key (id, w))"],
        key=["id", "w"],
        drift=False,
    ),
    "identity": Shape(
        "create table t (id int generated always as identity primary key, v int, w text)",
        ["create table t (id int generated always as identity primary key, v int, w text)"],
    ),
    "no-unique-index-here": Shape(PLAIN, ["create table t (id int, v int, w text)"]),
    "partitions-a-row-moves-between": Shape(
        PLAIN,
        [
            "create table t (id int, v int, w text) partition by range (v)",
            "create table t_low partition of t for values from (minvalue) to (50)",
            "create table t_high partition of t for values from (50) to (maxvalue)",
        ],
    ),
    "row-filter": Shape(PLAIN, [PLAIN], row_filter="(v > 50)"),
    "column-list": Shape(
        PLAIN, ["create table t (id int primary key, v int, w text default 'here')"], column_list=["id", "v"]
    ),
    "rule": Shape(
        PLAIN, [PLAIN, "create rule t_r as on update to t where new.v = -1 do instead nothing"], drift=False
    ),
}


def events(
    shape: Shape, start: dict[tuple, dict], seed: int, kinds: str
) -> tuple[list[tuple[str, dict]], dict[tuple, dict]]:
    """A provider's batch from `start`: each key inserted (unless `kinds` is no-inserts),
    updated, deleted, inserted again at random, 1,500 tries over 300 keys - or (only-inserts)
    keys 201-400 inserted; and its rows after them."""
    rng = random.Random(seed)
    rows = {k: dict(r) for k, r in start.items()}
    out: list[tuple[str, dict]] = []
    key_only, inserts = shape.key_only, kinds != "no-inserts"
    if kinds == "only-inserts":
        new = [
            {"id": i, "w": "n"} if key_only else {"id": i, "v": rng.randint(0, 100), "w": "n"}
            for i in range(201, 401)
        ]
        out = [("I", r) for r in new]
        return out, rows | {tuple(r[c] for c in shape.key): r for r in new}
    if shape.drift:
        out += [("U", rows[(5,)] | {"v": 99})] + [("I", {"id": 201, "v": 77, "w": "new"})] * inserts
        rows |= {(r["id"],): r for _, r in out}
    for _ in range(1500):
        i = rng.randint(1, 300)
        new = {"id": i, "v": rng.randint(0, 100), "w": rng.choice(["a", "b", None, "it's"])}
        if key_only:
            new = {"id": i, "w": rng.choice(["a", "b"])}
        k = tuple(new[c] for c in shape.key)
        if k in rows and rng.random() < 0.3:
            out.append(("D", rows.pop(k)))
        elif k in rows and not key_only:
            rows[k] = new
            out.append(("U", new))
        elif k not in rows and inserts:
            rows[k] = new
            out.append(("I", new))
    return out, rows


def subscriber_rows(shape: Shape, rows: dict[tuple, dict]) -> set[tuple]:
    """What the subscriber must hold of these provider rows."""
    cols = shape.column_list or list(next(iter(rows.values())).keys())
    kept = [r for r in rows.values() if shape.row_filter is None or (r["v"] is not None and r["v"] > 50)]
    return {tuple(r[c] for c in cols) for r in kept}


@pytest.mark.parametrize("kinds", ["inserts-too", "no-inserts", "only-inserts"])
@pytest.mark.parametrize("form", ["merge", "cte"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_a_staged_batch_leaves_the_rows_its_events_say(make_db, name, form, kinds, caplog):
    """`merge`: a table's events without inserts go through one MERGE (with inserts, or
    `cte`, the CTE form; inserts alone, one INSERT).  With drift the subscriber holds key 201
    already, which the batch inserts: the INSERT fails, and the CTE form upserts it."""
    shape = SHAPES[name]
    caplog.set_level(logging.INFO, logger="pgcascade.apply")
    prov, sub = make_db(), make_db(installed=True)
    key_only = shape.key_only
    start = {
        (i, "a") if key_only else (i,): {"id": i, "w": "a"} if key_only else {"id": i, "v": i % 100, "w": "w"}
        for i in range(1, 201)
    }
    with prov.connect() as c:
        c.execute(shape.provider)
    with sub.connect() as c:
        for ddl in shape.subscriber:
            c.execute(ddl)
        cols = list(next(iter(start.values())).keys())
        written = shape.column_list or cols
        initial = dict(start)
        if shape.drift:
            lost = () if kinds == "only-inserts" else (5, 6)  # rows its updates write
            initial = {k: r for k, r in start.items() if k[0] not in lost}
            if kinds != "no-inserts":
                initial[(201,)] = {"id": 201, "v": -7, "w": "old"}
        for r in initial.values():
            if shape.row_filter is None or r["v"] > 50:
                c.execute(
                    "insert into t ({}) overriding system value values ({})".format(
                        ", ".join(written), ", ".join(["%s"] * len(written))
                    ),
                    [r[x] for x in written],
                )
    batch, final = events(shape, start, seed=sum(map(ord, name)), kinds=kinds)

    with prov.connect() as p, sub.connect() as s:
        st = SubscriberTable(
            "public.t",
            "public.t",
            shape.key,
            TableState.parse("ok"),
            None,
            None,
            None,
            False,
            False,
            None,
            row_filter=shape.row_filter,
            column_list=shape.column_list,
        )
        applier = TableApplier.build(s, p, st, "json")
        if form == "cte":
            applier.merge_sql = None
        with s.transaction():
            s.execute("set local session_replication_role = replica")
            ensure_stage(s)
            with s.cursor().copy(
                f"copy {STAGE_TABLE} (ev_id, ev_txid, ev_type, ev_data, ev_extra1) from stdin"
            ) as cp:
                for ev_id, (kind, row) in enumerate(batch, start=1000):
                    cp.write_row((ev_id, 7, kind, json.dumps(row), "public.t"))
            stats = apply_staged(s, {"public.t": applier})
        assert stats.count == len(batch)
        # MERGE refuses a table with rules: the CTE form, then row by row
        assert applier.merge_refused == (form == "merge" and name == "rule" and kinds == "no-inserts")
        # inserts alone: one INSERT where the destination has a unique index and no row filter,
        # which the key held here already makes fail
        plain_insert = kinds == "only-inserts" and applier.insert_sql is not None
        no_plain = ("no-unique-index-here", "partitions-a-row-moves-between", "row-filter")
        assert plain_insert == (kinds == "only-inserts" and name not in no_plain)
        assert ("here already; applying with ON CONFLICT" in caplog.text) == (plain_insert and shape.drift)

        got = set(s.execute("select {} from t".format(", ".join(shape.column_list or cols))).fetchall())
    assert got == subscriber_rows(shape, final)
