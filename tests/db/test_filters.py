"""Row filters and column lists on a leaf (add-table --where, --columns): the leaf holds exactly
the root's matching rows and listed columns while updates move rows into and out of the filter,
set-based and row by row; and every refusal is one line.

The expected rows are computed on the root by the test's own query (the filter as the test
writes it), never by pgcascade; both sides are checksummed by PostgreSQL.
"""

from __future__ import annotations

import json

import pytest
from conftest import query_checksum as checksum
from test_replication_cli import one_line, run

from pgcascade.core.errors import UserError
from pgcascade.replica import filters
from pgcascade.replica import tables as subscriber

ORDERS = "public.orders"
EU = "region = 'eu'"
LISTED = "id, region, amount"


def assert_filtered(replica, table: str = ORDERS, where: str = EU, cols: str = LISTED) -> None:
    want = checksum(replica.root, f"select {cols} from {table} where {where}")
    got = checksum(replica.leaf, f"select {cols} from {table}")
    assert want[0] > 0 and got == want, f"{table}: leaf {got}, root's matching rows {want}"


def make_orders(db, table: str = ORDERS, key: str = "primary key") -> None:
    run(
        db,
        f"create table {table} (id int not null {key}, region text not null, amount numeric, secret text)",
        f"insert into {table} select i, (array['eu', 'us', 'asia'])[1 + i % 3], i * 1.5, 'pii ' || i"
        " from generate_series(1, 300) i",
    )


def move_rows(db, table: str = ORDERS) -> None:
    """Writes that move rows into and out of the filter, in one transaction and in several."""
    with db.connect() as conn:
        conn.execute(f"update {table} set region = 'us' where region = 'eu' and id % 5 = 0")  # out
        conn.execute(f"update {table} set region = 'eu' where region = 'asia' and id % 4 = 0")  # in
        conn.execute(f"update {table} set amount = amount + 1 where region = 'eu' and id % 3 = 0")
        conn.execute(f"update {table} set secret = 'changed' where id % 2 = 0")  # not a listed column
        conn.execute(f"update {table} set id = id + 10000 where region = 'eu' and id % 7 = 0")  # key
        conn.execute(f"delete from {table} where id % 11 = 0")
        conn.execute(f"insert into {table} values (5001, 'eu', 1, 's'), (5002, 'us', 2, 's')")
        with conn.transaction():  # out and back in, in the same batch; in and out again
            conn.execute(f"update {table} set region = 'us' where id between 20 and 40")
            conn.execute(f"update {table} set region = 'eu', amount = -1 where id between 20 and 30")
            conn.execute(f"update {table} set region = 'eu' where id = 5002")
            conn.execute(f"update {table} set region = 'asia' where id = 5002")


NOTES = "public.notes"  # no unique index on its key on either side: applied row by row


@pytest.mark.parametrize("capture", ["trigger", "logical"])
def test_filtered_leaf_holds_the_matching_rows_as_they_move(replica, capture):
    """Logical capture: pgoutput's UPDATE carries the whole new row too (a TOASTed value it
    leaves out is filled from the old row), a DELETE only the key."""
    make_orders(replica.root)
    run(replica.root, "insert into orders values (9000, 'eu', 1, repeat('big', 10000))")  # TOASTed
    for db in (replica.root, replica.leaf):
        make_orders(db, NOTES, key="")
    run(replica.leaf, f"delete from {NOTES} where region <> 'eu'", f"alter table {NOTES} drop column secret")
    replica.run("root", "create-root", "root", *(["--capture=logical"] if capture == "logical" else []))
    replica.run("leaf", "create-leaf", "leaf1", "--provider", replica.root.connstr)
    replica.run("root", "add-table", ORDERS)
    replica.run("root", "add-table", NOTES, "--key", "id")
    if capture == "logical":
        replica.daemons.start(str(replica.root_ini), "capture")
    # a LIKE pattern's % is no placeholder in the apply's statements, which have parameters
    out = replica.cli(
        "leaf",
        "add-table",
        ORDERS,
        "--where",
        "region like 'e%' -- the EU shop",
        "--columns",
        LISTED,
        "--create",
    )
    assert out.stdout.strip() == f"added {ORDERS}"
    replica.cli(
        "leaf", "add-table", NOTES, "--where", "region in ('eu')", "--columns", LISTED, "--expect-sync"
    )
    # the leaf's table has the listed columns only
    cols = replica.leaf.scalar(
        "select string_agg(attname, ', ' order by attnum) from pg_attribute"
        " where attrelid = 'public.orders'::regclass and attnum > 0 and not attisdropped"
    )
    assert cols == LISTED
    listed = replica.cli("leaf", "tables").stdout
    assert "where (region ~~ 'e%'::text)" in listed and "columns id, region, amount" in listed, listed
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    assert_filtered(replica)  # the first copy
    move_rows(replica.root)
    move_rows(replica.root, NOTES)
    run(replica.root, "update orders set region = 'us' where id = 9000")  # its TOASTed value unchanged
    replica.wait_sync()
    assert_filtered(replica)  # the set-based apply
    assert_filtered(replica, NOTES)  # row by row
    moved_in = "select count(*) from orders where amount = -1"  # out and back in, in one batch
    assert replica.leaf.scalar(moved_in) == replica.root.scalar(moved_in) > 5
    assert replica.leaf.scalar("select count(*) from orders where id = 5002") == 0  # in and out again
    row = json.loads(replica.cli("leaf", "tables", "--json").stdout)[1]
    assert row["where"] == "(region ~~ 'e%'::text)" and row["columns"] == ["id", "region", "amount"], row
    row = json.loads(replica.cli("leaf", "status", "--json").stdout)["tables"][1]
    assert row["where"] == "(region ~~ 'e%'::text)" and row["columns"] == ["id", "region", "amount"], row


def test_refusals_are_one_line_and_change_nothing(replica, make_db):
    make_orders(replica.root)
    run(replica.root, "create table public.other (id int primary key, region text)")
    run(replica.root, "create table public.seedfmt (id int primary key, region text)")
    make_orders(replica.leaf)
    replica.setup()
    replica.cli("root", "add-table", ORDERS, "public.other")
    replica.cli("root", "add-table", "public.seedfmt", "--format=sql")

    def refused(*args: str, node: str = "leaf") -> str:
        return one_line(replica.cli(node, "add-table", *args, check=False))

    def refused_here(*tables: str, where: str | None = None, columns: str | None = None, **opts) -> str:
        """The same refusal as add-table's, from the function it calls (a process each is slow)."""
        subset = filters.Subset(where, filters.parse_columns(columns) if columns else None)
        with replica.leaf.connect() as conn, replica.root.connect() as prov, pytest.raises(UserError) as e:
            subscriber.add_tables(conn, prov, "rep", list(tables), subset=subset, **opts)
        return str(e.value)

    assert "must include the key of public.orders (id): id missing" in refused_here(ORDERS, columns="region")
    assert "has no column 'nope'" in refused_here(ORDERS, columns="id,nope")
    assert 'column "nope" does not exist' in refused_here(ORDERS, where="nope = 1")
    assert "must be marked IMMUTABLE" in refused_here(ORDERS, where="amount > random()")
    assert "subquery" in refused_here(ORDERS, where="id in (select 1)")
    assert "must be type boolean" in refused_here(ORDERS, where="amount")
    # a second statement never runs: the extended protocol refuses it, and nothing is left behind
    line = refused(ORDERS, "--where", "true); drop table public.orders; select (1")
    assert "multiple commands" in line, line
    assert "syntax error" in refused_here(ORDERS, where="true); drop table public.orders; --")
    assert "syntax error" in refused_here(ORDERS, where="true) or (true")
    assert replica.leaf.scalar("select count(*) from public.orders") == 300
    assert "exactly one table" in refused_here(ORDERS, "public.other", where=EU)
    assert "partial-SQL" in refused_here("public.seedfmt", where="true", create=True)
    assert "the root captures whole rows" in refused(ORDERS, "--where", EU, node="root")
    assert replica.cli("leaf", "tables").stdout == ""
    # once added, its filter stays until it is removed and added again
    replica.cli("leaf", "add-table", ORDERS, "--where", EU, "--expect-sync")
    assert "replicated here already (where (region = 'eu'::text), every column)" in refused_here(
        ORDERS, where="true"
    )
    # a branch carries whole rows on
    branch = make_db("b")
    replica.ini("branch", branch)
    replica.cli("branch", "create-branch", "branch1", "--provider", replica.root.connstr)
    assert "are for a leaf, and branch1 is a branch" in refused(
        ORDERS, "--where", EU, "--create", node="branch"
    )


def test_a_repair_sent_down_the_cascade_honours_the_filter(replica):
    """A repair run on a branch reaches a leaf below it as pgcascade.repair events of the root's
    rows (sql/replica/94_repair.sql): the filtered leaf inserts only the rows its filter passes."""
    from pgcascade.replica.apply import APPLY_SETTINGS, TableApplier
    from pgcascade.replica.stage import STAGE_TABLE, ensure_stage

    make_orders(replica.root)
    make_orders(replica.leaf)
    run(replica.leaf, "alter table orders drop column secret")
    replica.setup()
    replica.cli("root", "add-table", ORDERS)
    replica.cli("leaf", "add-table", ORDERS, "--where", EU, "--columns", LISTED, "--expect-sync")
    rows = [
        {"id": i, "region": r, "amount": 7, "secret": "pii"} for i, r in ((1, "eu"), (2, "us"), (3, "eu"))
    ]
    with replica.leaf.connect() as conn, replica.root.connect() as prov, conn.transaction():
        conn.execute(APPLY_SETTINGS)  # as the worker applies a batch
        a = TableApplier.build(conn, prov, subscriber.get_table(conn, "rep", ORDERS), "json")
        ensure_stage(conn)
        conn.execute(
            f"insert into {STAGE_TABLE} (ev_id, ev_type, ev_data, ev_extra1) values (1, 'pgcascade.repair', %s, %s)",
            (json.dumps({"keys": [{"id": i} for i in (1, 2, 3, 4)], "rows": rows}), ORDERS),
        )
        a.apply_repair(conn, 1)
    got = [
        tuple(r)
        for r in replica.leaf.connect().execute(
            "select id, region, amount from orders where id <= 4 order by id"
        )
    ]
    assert got == [(1, "eu", 7), (3, "eu", 7)], got
