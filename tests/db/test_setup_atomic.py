"""Setup commands are all or nothing: a failed create-root or create-leaf leaves nothing that
blocks a retry, and a create-leaf killed between its own commit and its provider's is
completed by running it again.  Each case ends with the retry replicating rows equal to the
root's, compared independently."""

from __future__ import annotations

import signal
import uuid

import psycopg
from conftest import table_checksum

from pgcascade.dev.localcluster import wait_until


def as_role(connstr: str, role: str) -> str:
    return connstr.replace("user=postgres", f"user={role}")


def leftovers(db) -> dict[str, int]:
    """What a node consists of in this database, counted."""
    with db.connect() as conn:
        return {
            what: conn.execute(f"select count(*) from {relation}").fetchone()[0]
            for what, relation in {
                "node": "pgcascade.node",
                "queue": "pgcascade.queue",
                "walcapture": "pgcascade.walcapture",
                "location": "pgcascade.node_location",
                "publication": "pg_publication",
                "slot": "pg_replication_slots where database = current_database()",
            }.items()
        }


NOTHING = {"node": 0, "queue": 0, "walcapture": 0, "location": 0, "publication": 0, "slot": 0}


def refuse_node_rows(db) -> None:
    """Make this node's own record fail (a trigger on pgcascade.node): any failure there."""
    with db.connect() as conn:
        conn.execute(
            "create function public.refuse() returns trigger language plpgsql as"
            " $$ begin raise exception 'refused for the test'; end $$"
        )
        conn.execute(
            "create trigger refuse before insert on pgcascade.node for each row execute function public.refuse()"
        )


def allow_node_rows(db) -> None:
    with db.connect() as conn:
        conn.execute("drop trigger refuse on pgcascade.node")


def test_a_failed_logical_create_root_can_be_followed_by_a_trigger_root(replica):
    """The role owns the database and its tables.  Without REPLICATION the logical root is
    refused before anything is made; with it, a slot that cannot be made (every slot in use)
    leaves nothing, and a failure after the slot was made drops the slot and the publication
    again.  A trigger root follows, and replicates."""
    role = f"owner_{uuid.uuid4().hex[:8]}"
    with replica.root.connect() as conn:
        conn.execute(f'create role "{role}" login')
        conn.execute(f'alter database "{replica.root.name}" owner to "{role}"')
        conn.execute(f'alter schema public owner to "{role}"')
    with psycopg.connect(as_role(replica.root.connstr, role), autocommit=True) as conn:
        conn.execute("create table public.t (id int primary key, v text)")
        conn.execute("insert into public.t select i, 'v' || i from generate_series(1, 50) i")
    replica.root_ini.write_text(replica.root_ini.read_text().replace("user=postgres", f"user={role}"))

    r = replica.cli("root", "create-root", "root", "--capture=logical", check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "REPLICATION" in r.stderr, r.stderr
    replica.cli("root", "install")
    assert leftovers(replica.root) == NOTHING

    with replica.root.connect() as conn:
        conn.execute(f'alter role "{role}" replication')
    # every replication slot of the server in use: the slot cannot be made, nothing is left
    with replica.root.connect() as conn:
        free = conn.execute(
            "select current_setting('max_replication_slots')::int - count(*) from pg_replication_slots"
        ).fetchone()[0]
        fillers = [f"filler_{uuid.uuid4().hex[:8]}" for _ in range(free)]
        for name in fillers:
            conn.execute("select pg_create_physical_replication_slot(%s)", (name,))
    try:
        r = replica.cli("root", "create-root", "root", "--capture=logical", check=False)
    finally:
        with replica.root.connect() as conn:
            for name in fillers:
                conn.execute("select pg_drop_replication_slot(%s)", (name,))
    assert r.returncode == 1 and "all replication slots are in use" in r.stderr, r.stderr
    assert leftovers(replica.root) == NOTHING
    # the rest fails after the slot was made: the slot and the publication go again
    refuse_node_rows(replica.root)
    r = replica.cli("root", "create-root", "root", "--capture=logical", check=False)
    assert r.returncode != 0 and "refused for the test" in r.stderr, r.stderr
    assert leftovers(replica.root) == NOTHING
    allow_node_rows(replica.root)

    assert (
        "created (capture trigger)" in replica.cli("root", "create-root", "root", "--capture=trigger").stdout
    )
    assert leftovers(replica.root) == {**NOTHING, "node": 1, "queue": 1, "location": 1}
    replica.cli("root", "add-table", "public.t")
    replica.cli("leaf", "create-leaf", "leaf1", "--provider", replica.root.connstr)
    replica.cli("leaf", "add-table", "public.t", "--create")
    replica.start_ticker()
    replica.start_worker()
    with psycopg.connect(as_role(replica.root.connstr, role), autocommit=True) as conn:
        conn.execute("update public.t set v = v || '!' where id % 3 = 0")
    replica.wait_sync(60)
    assert table_checksum(replica.root, "public.t")[0] == 50
    replica.assert_equal("public.t")
    replica.daemons.close()
    with replica.root.connect() as conn:
        conn.execute(f'alter database "{replica.root.name}" owner to postgres')
        conn.execute(f'drop owned by "{role}" cascade')
        conn.execute(f'drop role "{role}"')


def consumers(db, queue: str) -> list[str]:
    with db.connect() as conn:
        return [
            r[0] for r in conn.execute("select consumer_name from pgcascade.get_consumer_info(%s)", (queue,))
        ]


def test_create_leaf_is_all_or_nothing_and_a_retry_completes_it(replica):
    with replica.root.connect() as conn:
        conn.execute("create table public.t (id int primary key, v text)")
        conn.execute("insert into public.t select i, 'v' || i from generate_series(1, 50) i")
    replica.cli("root", "create-root", "root")
    replica.cli("root", "add-table", "public.t")

    # an unreachable provider: nothing here but the schema
    port = replica.root.cluster.port
    r = replica.cli(
        "leaf",
        "create-leaf",
        "leaf1",
        "--provider",
        replica.root.connstr.replace(f"port={port}", "port=1"),
        check=False,
    )
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert leftovers(replica.leaf)["node"] == 0

    # this node's own record fails: the provider is left as it was (no consumer holding its history)
    refuse_node_rows(replica.leaf)
    r = replica.cli("leaf", "create-leaf", "leaf1", "--provider", replica.root.connstr, check=False)
    assert r.returncode != 0 and "refused for the test" in r.stderr, r.stderr
    assert "leaf1" not in consumers(replica.root, "rep")
    assert leftovers(replica.leaf)["node"] == 0
    allow_node_rows(replica.leaf)

    # killed between its own commit and the provider's: the node exists, unregistered...
    p = replica.daemons.start(
        str(replica.leaf_ini),
        "create-leaf",
        "leaf1",
        "--provider",
        replica.root.connstr,
        env={"PGCASCADE_PAUSE_AT": "recorded-not-registered"},
    )
    wait_until(lambda: "pause point recorded-not-registered" in p.output(), 60, what="the pause point")
    replica.daemons.kill(p, signal.SIGKILL)
    assert leftovers(replica.leaf)["node"] == 1
    wait_until(lambda: "leaf1" not in consumers(replica.root, "rep"), 10, what="the provider's rollback")

    # ... and the same command again registers it where it is
    out = replica.cli("leaf", "create-leaf", "leaf1", "--provider", replica.root.connstr)
    assert "exists already" in out.stdout and "registered again on its provider" in out.stderr, out
    assert "leaf1" in consumers(replica.root, "rep")
    replica.cli("leaf", "add-table", "public.t", "--create")
    replica.start_ticker()
    replica.start_worker()
    with replica.root.connect() as conn:
        conn.execute("update public.t set v = v || '!' where id % 3 = 0")
        conn.execute("insert into public.t select i, 'new' from generate_series(51, 60) i")
    replica.wait_sync(60)
    replica.assert_equal("public.t")
