"""pgcascade as a DBA runs it on a production database: every connection as an ordinary role.

The role `repl` owns the node databases (and so the tables it creates there) and has exactly
the grants docs/operations.md ("Security") lists: nothing more on the root, SET on
session_replication_role where changes are applied.  Its password is in the DSNs the user types
and in a password file (PGPASSFILE, `passfile=`) - the servers ask for it (scram).  The
application writes through pgbench as a role that owns nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import Daemons, Database, drop_roles, run_cli, run_in_process, table_checksum
from test_replication import PGBENCH_TABLES

from pgcascade.core.pgbin import pg_bindir
from pgcascade.dev.localcluster import LocalCluster, wait_until

SRR_GRANT = "GRANT SET ON PARAMETER session_replication_role TO"


@dataclass
class Restricted:
    """The test's roles on some session clusters: `repl` (pgcascade's), `app` (owns nothing)."""

    tmp: Path
    repl: str = field(default_factory=lambda: f"repl_{uuid.uuid4().hex[:8]}")
    app: str = field(default_factory=lambda: f"app_{uuid.uuid4().hex[:8]}")
    password: str = field(default_factory=lambda: f"Pw-{uuid.uuid4().hex}")
    app_password: str = field(default_factory=lambda: f"App-{uuid.uuid4().hex}")
    clusters: list[LocalCluster] = field(default_factory=list)
    dbs: list[Database] = field(default_factory=list)

    @property
    def passfile(self) -> Path:
        return self.tmp / "pgpass"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PGPASSFILE": str(self.passfile)}

    def dsn(self, db: Database, role: str | None = None) -> str:
        return f"host=127.0.0.1 port={db.cluster.port} user={role or self.repl} dbname={db.name}"

    def hba_line(self) -> str:
        return f"host all {self.repl},{self.app} 127.0.0.1/32 scram-sha-256\n"

    def add_cluster(self, c: LocalCluster) -> None:
        """The roles, asked for their passwords on this cluster (the other roles stay trusted)."""
        hba = c.datadir / "pg_hba.conf"
        hba.write_text(self.hba_line() + hba.read_text())
        with c.connect() as conn:
            conn.execute(f"create role {self.repl} login password '{self.password}'")
            conn.execute(f"create role {self.app} login password '{self.app_password}'")
            # every statement pgcascade's role sends is in the server log: no password may be
            conn.execute(f"alter role {self.repl} set log_statement = 'all'")
            conn.execute("select pg_reload_conf()")
        with self.passfile.open("a") as f:
            f.write(f"127.0.0.1:{c.port}:*:{self.repl}:{self.password}\n")
            f.write(f"127.0.0.1:{c.port}:*:{self.app}:{self.app_password}\n")
        self.passfile.chmod(0o600)
        self.clusters.append(c)

    def own(self, db: Database) -> Database:
        with db.cluster.connect() as conn:
            conn.execute(f'alter database "{db.name}" owner to {self.repl}')
        self.dbs.append(db)
        return db

    def grant_srr(self, c: LocalCluster, on: bool = True) -> None:
        with c.connect() as conn:
            verb = "grant" if on else "revoke"
            conn.execute(
                f"{verb} set on parameter session_replication_role {'to' if on else 'from'} {self.repl}"
            )

    def drop(self) -> None:
        for c in self.clusters:
            hba = c.datadir / "pg_hba.conf"
            hba.write_text(hba.read_text().replace(self.hba_line(), ""))
            with c.connect() as conn:
                conn.execute("select pg_reload_conf()")
        drop_roles(self.dbs, self.repl, self.app)


@pytest.fixture
def restricted(make_db, tmp_path: Path) -> Iterator[Restricted]:
    r = Restricted(tmp_path)
    yield r
    r.drop()


def cli(ini: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command, in this process (its environment has the password file); the daemons, and
    the refusal the test is about, run as processes."""
    out = run_in_process(ini, *args)
    assert out.returncode == 0, (
        f"pgcascade {ini.stem} {' '.join(args)}: rc {out.returncode}\n{out.stdout}{out.stderr}"
    )
    return out


def test_every_connection_as_an_ordinary_role(
    restricted, make_db, tmp_path: Path, daemons: Daemons, monkeypatch: pytest.MonkeyPatch
):
    """root -> branch -> leaf, trigger capture, pgbench as a role that owns nothing: the
    subscribers end equal to the root, and no password is in any node's dump or server log."""
    r = restricted
    monkeypatch.setenv("PGPASSFILE", str(r.passfile))  # for the commands run in this process
    root, branch, leaf = make_db("a"), make_db("b"), make_db("b")
    for c in (root.cluster, branch.cluster):
        r.add_cluster(c)
    for db in (root, branch, leaf):
        r.own(db)
    subprocess.run(
        [str(pg_bindir() / "pgbench"), "-i", "-q", "-s", "1", "-n", r.dsn(root)],
        check=True,
        capture_output=True,
        env=r.env,
    )
    with root.connect() as conn:  # as the owner would: the key pgbench_history lacks; the app's rights
        conn.execute(f"set role {r.repl}")
        conn.execute("alter table pgbench_history add column hid bigserial primary key")
        conn.execute(f"grant select, insert, update, delete on {', '.join(PGBENCH_TABLES)} to {r.app}")
        conn.execute(f"grant usage on sequence pgbench_history_hid_seq to {r.app}")

    def ini(name: str, db: Database) -> Path:
        path = tmp_path / f"{name}.ini"
        path.write_text(
            f"[pgcascade]\njob_name = {name}\ndb = {r.dsn(db)}\nqueue_name = shop\n"
            f"logfile = {tmp_path}/{name}.log\npidfile = {tmp_path}/{name}.pid\nmaint_period = 1\n"
        )
        return path

    root_ini, branch_ini, leaf_ini = ini("root", root), ini("branch", branch), ini("leaf", leaf)
    with_password = f"{r.dsn(root)} password={r.password}"
    out = cli(root_ini, "create-root", "root", with_password)
    assert "password in location is not stored" in out.stdout
    cli(root_ini, "add-table", "--all")

    # a subscriber's role without SET on session_replication_role: refused up front, in one line
    refused = run_cli(branch_ini, "create-branch", "branch", "--provider", with_password, env=r.env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.count("\n") == 1 and f"{SRR_GRANT} {r.repl}" in refused.stderr, refused.stderr
    assert branch.scalar("select to_regnamespace('pgcascade')") is None  # nothing was made
    r.grant_srr(branch.cluster)
    out = cli(branch_ini, "create-branch", "branch", "--provider", with_password)
    assert "password in --provider is not stored" in out.stdout
    cli(leaf_ini, "create-leaf", "leaf", "--provider", f"{r.dsn(branch)} passfile={r.passfile}")
    for node in (branch_ini, leaf_ini):
        cli(node, "add-table", "--all", "--create")

    # the grant taken away before the daemons start: the error, with the grant, in status --check
    r.grant_srr(branch.cluster, on=False)
    daemons.start("ticker", str(ini("ticker", root)), env={"PGPASSFILE": str(r.passfile)})
    for node in (branch_ini, leaf_ini):
        daemons.start(str(node), "worker", env={"PGPASSFILE": str(r.passfile)})

    def critical() -> str | None:
        check = run_in_process(branch_ini, "status", "--check")
        return check.stdout if check.returncode == 2 and SRR_GRANT in check.stdout else None

    line = wait_until(critical, timeout=60, what="status --check to name the missing grant")
    assert line.startswith("CRITICAL branch") and line.count("\n") == 1, line

    def copy_refused() -> bool:  # the copy processes too, each with its table
        tables = json.loads(run_in_process(branch_ini, "tables", "--json").stdout)
        return any(SRR_GRANT in (t["last_error"] or "") for t in tables)

    wait_until(copy_refused, timeout=60, what="a copy's error with the grant in tables --json")
    r.grant_srr(branch.cluster)  # and it recovers by itself

    bench = subprocess.run(
        [str(pg_bindir() / "pgbench"), "-n", "-c", "2", "-T", "8", r.dsn(root, r.app)],
        capture_output=True,
        text=True,
        env=r.env,
    )
    assert bench.returncode == 0 and "failed transactions: 0 " in bench.stdout, bench.stdout + bench.stderr
    for node in (branch_ini, leaf_ini):
        cli(node, "wait-sync", "--timeout", "120")
        assert cli(node, "status", "--check").stdout.startswith("OK")

    assert table_checksum(root, "pgbench_history")[0] > 100
    for t in PGBENCH_TABLES:
        assert table_checksum(root, t) == table_checksum(branch, t) == table_checksum(leaf, t), t

    for db in (root, branch, leaf):
        dump = subprocess.run(
            [str(pg_bindir() / "pg_dump"), db.connstr], capture_output=True, text=True, check=True
        ).stdout
        assert "node_location" in dump and r.password not in dump, f"a password in the dump of {db.name}"
    for c in r.clusters:
        log = c.logfile.read_text(errors="replace")
        assert "pgcascade.next_batch" in log or "pgcascade.ticker" in log, "log_statement did not log"
        assert r.password not in log, f"a password in the server log of cluster {c.name}"
