"""Least privilege: what roles other than pgcascade's own can and cannot do on its nodes, what
pgcascade's own role needs, and that no password is stored.

An application rarely connects as the table owner.  A role that owns nothing and holds only
SELECT/INSERT/UPDATE/DELETE/TRUNCATE on a captured table must keep writing it exactly as
before pgcascade was there (the capture triggers run as their owner), its changes must reach
the subscriber, and it must not be able to use pgcascade's functions for tables of its own.
pgcascade's role is refused up front, in one line naming the grant, what it could not do later
(docs/operations.md, "Security"); a password in a location is never stored (nor was, after the
upgrade).  The whole set run as such roles is tests/scenario/test_least_privilege.py.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from conftest import SECRET_DSNS, drop_roles, run_in_process, table_checksum
from psycopg.conninfo import conninfo_to_dict

from pgcascade.core import schema
from pgcascade.core.pgconn import without_secrets
from pgcascade.dev.localcluster import wait_until


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


# functions and operators the capture functions use, shadowed in a schema of the application's
# own ahead of pg_catalog: each raises if it is ever called (the trigger functions run as their
# owner, with the caller's search_path, and must resolve none of their names through it)
TRAPS = [
    "function {s}.format(text, name, name) returns text",
    "function {s}.current_setting(text, boolean) returns text",
    "function {s}.nextval(regclass) returns bigint",
    "function {s}.now() returns timestamptz",
    "function {s}.clock_timestamp() returns timestamptz",
    "function {s}.row_to_json(record) returns json",
    "function {s}.jsonb_typeof(jsonb) returns text",
    "function {s}.pg_notify(text, text) returns void",
    "function {s}.pg_sequence_last_value(regclass) returns bigint",
    "function {s}.left(text, integer) returns text",
    "function {s}.quote_nullable(text) returns text",
    "function {s}.eq_text(text, text) returns boolean",
    "function {s}.eq_int(integer, integer) returns boolean",
    "function {s}.gt_int8(bigint, bigint) returns boolean",
    "function {s}.cat_text(text, text) returns text",
]
TRAP_OPERATORS = [
    "operator {s}.= (leftarg = text, rightarg = text, function = {s}.eq_text)",
    "operator {s}.<> (leftarg = text, rightarg = text, function = {s}.eq_text)",
    "operator {s}.= (leftarg = integer, rightarg = integer, function = {s}.eq_int)",
    "operator {s}.> (leftarg = bigint, rightarg = bigint, function = {s}.gt_int8)",
    "operator {s}.|| (leftarg = text, rightarg = text, function = {s}.cat_text)",
]


def test_an_application_role_resolves_nothing_in_the_capture_functions_by_its_search_path(replica, app_role):
    """The capture functions run as their owner at every statement, with the writer's own
    search_path (a SET on them cost every call): every name in them is qualified. A role that
    puts a schema of its own ahead of pg_catalog, with a function or operator of the same name
    and argument types as each they use, has none of them called, and its changes replicate."""
    for db in (replica.root, replica.leaf):
        run(
            db,
            "create table accounts (id int primary key, v text)",
            "create table notes (k text primary key, j jsonb, f float8)",
            "create table legacy (id int primary key, v text)",
            f'grant select, insert, update, delete on accounts, notes, legacy to "{app_role}"',
        )
    replica.setup(["accounts", "notes"], leaf_args=())
    replica.run("root", "add-table", "legacy", "--format=sql")  # the seed's partial SQL events
    replica.run("leaf", "add-table", "legacy")
    run(replica.root, f'create schema shadow authorization "{app_role}"')
    replica.start_ticker()
    replica.start_worker()
    with connect_as(replica.root, app_role) as app:
        for t in TRAPS:
            app.execute(
                f"create {t.format(s='shadow')} language plpgsql"
                f" as $$ begin raise exception 'hijacked: {t.format(s='shadow').split('(')[0]}'; end $$"
            )
        for o in TRAP_OPERATORS:
            app.execute(f"create {o.format(s='shadow')}")
        app.execute("set search_path = shadow, pg_catalog, public")
        # none of the application's own statements uses a shadowed name
        app.execute("insert into accounts values (1, 'a'), (2, 'b'), (3, 'c')")
        app.execute(
            "insert into notes values ('x', '{\"a\": 1}', 1.5), ('y', 'null', 0.1), ('z', null, null)"
        )
        app.execute("update accounts set v = 'changed' where id between 2 and 3")
        app.execute("update accounts set id = 10 where id between 3 and 3")  # a key change
        app.execute("update notes set f = 2.25 where k between 'x' and 'x'")
        app.execute("delete from accounts where id between 1 and 1")
        app.execute("delete from notes where k between 'z' and 'z'")
        app.execute("insert into legacy values (1, 'it''s'), (2, null)")
        app.execute("update legacy set v = 'two' where id between 2 and 2")
    replica.wait_sync()
    replica.assert_equal("public.accounts", "public.notes", "public.legacy")
    assert (
        replica.leaf.scalar("select string_agg(id || v, ',' order by id) from accounts")
        == "2changed,10changed"
    )
    assert replica.leaf.scalar("select j is not null and jsonb_typeof(j) = 'null' from notes where k = 'y'")


# --- what pgcascade's own role needs: refused up front, in one line naming the grant -----------------


@pytest.fixture
def repl(replica) -> Iterator[str]:
    """A login role with no privilege at all yet on either node's cluster."""
    name = f"repl_{uuid.uuid4().hex[:8]}"
    for db in (replica.root, replica.leaf):
        run(db, f'create role "{name}" login')
    yield name
    drop_roles([replica.root, replica.leaf], name)


def ini_as(replica, node: str, role: str) -> None:
    """The node's ini connects as `role` from now on."""
    path = replica.tmp / f"{node}.ini"
    path.write_text(path.read_text().replace("user=postgres", f"user={role}"))


def verb(replica, node: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`pgcascade NODE.ini ARGS`, run in this process; it must succeed."""
    r = run_in_process(replica.tmp / f"{node}.ini", *args)
    assert r.returncode == 0, f"{node} {' '.join(args)}: rc {r.returncode}\n{r.stdout}{r.stderr}"
    return r


def refused(replica, node: str, *args: str) -> str:
    """The command's one-line refusal (exit 2)."""
    r = run_in_process(replica.tmp / f"{node}.ini", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, f"rc {r.returncode}\n{r.stdout}{r.stderr}"
    assert r.stderr.startswith("pgcascade: role "), r.stderr
    return r.stderr


def test_setup_commands_name_the_grant_the_role_lacks(replica, repl):
    for node, db in (("root", replica.root), ("leaf", replica.leaf)):
        ini_as(replica, node, repl)
        run(db, "create table t (id int primary key, v text)")  # owned by postgres, not by repl

    assert f"GRANT CREATE ON DATABASE {replica.root.name} TO {repl}" in refused(
        replica, "root", "create-root", "r"
    )
    run(replica.root, f'alter database "{replica.root.name}" owner to "{repl}"')
    assert f"ALTER ROLE {repl} REPLICATION" in refused(
        replica, "root", "create-root", "r", "--capture=logical"
    )
    assert replica.root.scalar("select to_regnamespace('pgcascade')") is None  # nothing was made
    verb(replica, "root", "create-root", "r")
    assert f"ALTER TABLE public.t OWNER TO {repl}" in refused(replica, "root", "add-table", "t")
    run(replica.root, f'alter table t owner to "{repl}"')
    verb(replica, "root", "add-table", "t")

    # a subscriber applies with session_replication_role = replica: it needs SET on it
    run(replica.leaf, f'alter database "{replica.leaf.name}" owner to "{repl}"')
    provider = replica.root.connstr.replace("user=postgres", f"user={repl}")
    srr = f"GRANT SET ON PARAMETER session_replication_role TO {repl}"
    assert srr in refused(replica, "leaf", "create-leaf", "l", "--provider", provider)
    run(replica.leaf, f'grant set on parameter session_replication_role to "{repl}"')
    verb(replica, "leaf", "create-leaf", "l", "--provider", provider)
    run(replica.leaf, f'revoke set on parameter session_replication_role from "{repl}"')
    assert srr in refused(replica, "leaf", "add-table", "t")
    run(replica.leaf, f'grant set on parameter session_replication_role to "{repl}"')
    assert f"ALTER TABLE public.t OWNER TO {repl}" in refused(replica, "leaf", "add-table", "t")
    run(replica.leaf, f'alter table t owner to "{repl}"')
    verb(replica, "leaf", "add-table", "t")
    assert replica.leaf.scalar("select count(*) from pgcascade.subscriber_table") == 1


# --- no stored secrets ----------------------------------------------------------------------------------


def test_locations_and_location_events_never_carry_a_password(replica):
    root_location = f"{replica.root.connstr} password=s3cret"
    out = verb(replica, "root", "create-root", "root", root_location).stdout
    assert "the password in location is not stored" in out
    c = replica.root.cluster
    provider = f"postgresql://postgres:s3cret@{c.address}:{c.port}/{replica.root.name}?application_name=x"
    out = verb(replica, "leaf", "create-leaf", "leaf1", "--provider", provider).stdout
    assert "the password in --provider is not stored" in out

    for db in (replica.root, replica.leaf):
        stored = dict(db.connect().execute("select node_name, node_location from pgcascade.node_location"))
        assert set(stored) == {"root", "leaf1"} and not any("s3cret" in loc for loc in stored.values())
        assert conninfo_to_dict(stored["root"])["dbname"] == replica.root.name
    events = [
        r[0]
        for r in replica.root.connect().execute(
            "select ev_extra1 from pgcascade.event where ev_type = 'pgcascade.location'"
        )
    ]
    assert events and not any("s3cret" in e for e in events)
    leaf_view = replica.leaf.scalar(
        "select node_location from pgcascade.node_location where node_name = 'root'"
    )
    expected = {k: v for k, v in conninfo_to_dict(provider).items() if k != "password"}
    assert conninfo_to_dict(leaf_view) == expected  # the provider as given, but its password


def test_the_upgrade_takes_passwords_out_of_stored_locations(make_db, write_config):
    """Migration 12 cleans what earlier releases stored, as pgconn.without_secrets would."""
    db = make_db()
    kept = ["host=h dbname=x", "host=h passfile=/etc/pgcascade/pgpass dbname=x"]
    with db.connect() as conn:
        schema.install(conn, target=11, with_functions=False)
        conn.execute("create table pgcascade.event_old partition of pgcascade.event for values in (1000)")
        for i, dsn in enumerate(SECRET_DSNS + kept):
            conn.execute("insert into pgcascade.node_location values ('q', %s, %s)", (f"n{i}", dsn))
            conn.execute(
                "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1)"
                " values (%s, now(), 1000, 'pgcascade.location', %s, %s)",
                (i, f"n{i}", dsn),
            )
        conn.execute(  # not a location: left alone
            "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1)"
            " values (99, now(), 1000, 'I', '{}', 'password=not-a-location')"
        )
    out = run_in_process(write_config("up", db=db.connstr), "install").stdout
    assert "node locations no longer carry passwords" in out, out
    with db.connect() as conn:
        locations = dict(conn.execute("select node_name, node_location from pgcascade.node_location"))
        events = dict(conn.execute("select ev_id, ev_extra1 from pgcascade.event"))
    for i, dsn in enumerate(SECRET_DSNS + kept):
        for cleaned in (locations[f"n{i}"], events[i]):
            assert conninfo_to_dict(cleaned) == conninfo_to_dict(without_secrets(dsn)), (dsn, cleaned)
            assert "s3" not in cleaned and "k3y" not in cleaned
    assert locations["n6"] == kept[0] and events[99] == "password=not-a-location"


def test_a_capture_daemon_refused_its_slot_says_what_to_grant_and_recovers(replica, repl):
    """Logical capture as an ordinary role (the database's owner, REPLICATION): the daemon that
    loses REPLICATION shows the grant in status --check, and once it is back captures on."""
    run(
        replica.root,
        f'alter database "{replica.root.name}" owner to "{repl}"',
        f'alter role "{repl}" replication',
    )
    ini_as(replica, "root", repl)
    with replica.root.connect() as conn:
        conn.execute(f'set role "{repl}"')
        conn.execute("create table t (id int primary key, v text)")
        conn.execute("insert into t select i, 'v' || i from generate_series(1, 50) i")
    verb(replica, "root", "create-root", "root", "--capture=logical")
    verb(replica, "root", "add-table", "t")
    verb(
        replica,
        "leaf",
        "create-leaf",
        "leaf1",
        "--provider",
        replica.root.connstr.replace("user=postgres", f"user={repl}"),
    )
    verb(replica, "leaf", "add-table", "t", "--create")
    run(replica.root, f'alter role "{repl}" noreplication')
    replica.daemons.start(str(replica.root_ini), "capture")
    replica.start_ticker()
    replica.start_worker()

    def critical() -> str | None:
        r = run_in_process(replica.root_ini, "status", "--check")
        return r.stdout if r.returncode == 2 and f"ALTER ROLE {repl} REPLICATION" in r.stdout else None

    assert "capture error" in wait_until(critical, timeout=60, what="the capture daemon's refusal in status")
    run(replica.root, f'alter role "{repl}" replication')
    run(replica.root, "update t set v = v || '!' where id % 2 = 0", "insert into t values (51, 'after')")
    replica.wait_sync()
    replica.assert_equal("public.t")
    assert verb(replica, "root", "status", "--check").stdout.startswith("OK root")


def test_add_peer_names_the_grant_a_master_lacks(replica, repl):
    """A two-way master applies its peers' changes: SET on session_replication_role."""
    for node, db in (("root", replica.root), ("leaf", replica.leaf)):
        run(db, f'alter database "{db.name}" owner to "{repl}"')
        ini_as(replica, node, repl)
    leaf_ini = replica.tmp / "leaf.ini"  # every master is the root of a queue of its own
    leaf_ini.write_text(leaf_ini.read_text().replace("queue_name = rep", "queue_name = rep_b"))
    verb(replica, "root", "create-root", "a")
    verb(replica, "leaf", "create-root", "b")
    b = replica.leaf.connstr.replace("user=postgres", f"user={repl}")
    srr = f"GRANT SET ON PARAMETER session_replication_role TO {repl}"
    assert srr in refused(replica, "root", "add-peer", "b", "--location", f"{b} password=s3cret")
    assert replica.root.scalar("select count(*) from pgcascade.node") == 1  # nothing was made
    run(replica.root, f'grant set on parameter session_replication_role to "{repl}"')
    out = verb(replica, "root", "add-peer", "b", "--location", f"{b} password=s3cret").stdout
    assert "the password in --location is not stored" in out
    assert "s3cret" not in replica.root.scalar(
        "select string_agg(node_location, ' ') from pgcascade.node_location"
    )
