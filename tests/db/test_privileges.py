"""Least privilege: what roles other than pgcascade's own can and cannot do on its nodes.

An application rarely connects as the table owner.  A role that owns nothing and holds only
SELECT/INSERT/UPDATE/DELETE/TRUNCATE on a captured table must keep writing it exactly as
before pgcascade was there (the capture triggers run as their owner), its changes must reach
the subscriber, and it must not be able to use pgcascade's functions for tables of its own.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from conftest import table_checksum


def run(db, *statements: str) -> None:
    with db.connect() as conn:
        for s in statements:
            conn.execute(s)


@pytest.fixture
def app_role(replica):
    """A login role that owns nothing: DML on public.accounts on both nodes, nothing else."""
    name = f"app_{uuid.uuid4().hex[:8]}"
    for db in (replica.root, replica.leaf):  # two clusters
        run(db, f'create role "{name}" login')
    yield name
    for db in (replica.root, replica.leaf):
        run(db, f'drop owned by "{name}"', f'drop role "{name}"')


def connect_as(db, role: str) -> psycopg.Connection:
    return psycopg.connect(db.connstr.replace("user=postgres", f"user={role}"), autocommit=True)


def test_an_application_role_that_owns_nothing_keeps_writing_a_captured_table(replica, app_role):
    for db in (replica.root, replica.leaf):
        run(
            db,
            "create table accounts (id int primary key, v text)",
            f'grant select, insert, update, delete, truncate on accounts to "{app_role}"',
            f'grant create on schema public to "{app_role}"',
            # a partitioned table: its partitions' triggers and the mark run for the role too
            "create table ledger (id int primary key, v text) partition by range (id)",
            "create table ledger_p0 partition of ledger for values from (0) to (1000)",
            f'grant select, insert, update, delete on ledger, ledger_p0 to "{app_role}"',
        )
    run(replica.root, "insert into accounts select i, 'v' || i from generate_series(1, 20) i")
    replica.setup(["accounts", "ledger"], leaf_args=())
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()

    with connect_as(replica.root, app_role) as app:
        # the grants it had are all it has: pgcascade's schema is closed to it
        assert not app.execute("select has_schema_privilege('pgcascade', 'usage')").fetchone()[0]
        app.execute("insert into accounts select i, 'new' from generate_series(21, 30) i")
        app.execute("update accounts set v = v || '!' where id % 3 = 0")
        app.execute("delete from accounts where id % 5 = 0")
        with app.transaction():
            app.execute("truncate accounts")
            app.execute("insert into accounts select i, 'after truncate' from generate_series(1, 7) i")
        app.execute("update accounts set id = id + 100 where id = 7")  # a key change
        app.execute("insert into ledger select i, 'through the table' from generate_series(1, 5) i")
        app.execute("insert into ledger_p0 values (6, 'naming the partition')")
        app.execute("update ledger_p0 set v = v || '!' where id < 3")
    replica.wait_sync()
    assert table_checksum(replica.root, "public.accounts")[0] == 7
    assert table_checksum(replica.root, "public.ledger")[0] == 6
    replica.assert_equal("public.accounts", "public.ledger")

    # the subscriber's write protection answers the application role with its own refusal
    with (
        connect_as(replica.leaf, app_role) as app,
        pytest.raises(psycopg.Error, match="replicated by pgcascade: local writes are refused"),
    ):
        app.execute("delete from accounts")

    # nor can it attach the capture functions to a table of its own and write events with them
    fn = replica.root.scalar(
        "select format('pgcascade.%I', 'capture_' || 'public.accounts'::regclass::oid || '_ins')"
    )
    with connect_as(replica.root, app_role) as app:
        app.execute("create table mine (id int primary key)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            app.execute(
                f"create trigger t after insert on mine referencing new table as pgcascade_new"
                f" for each statement execute function {fn}()"
            )
