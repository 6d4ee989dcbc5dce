"""The COPY stream between two databases (copystream.py): psql on the provider's side, or the
psycopg relay where no psql is found.  Real clusters; the provider fails part-way through."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from pgcascade.core import copystream
from pgcascade.core.errors import RuntimeFailure

ROWS = (
    "select i, case when i %% 3 = 0 then null else 'v' || i || e'\\t\\\\ ü' end,"
    " date '2026-01-31' + i, timestamptz '2026-01-31 23:30+05' + i * interval '1 minute', %s::numeric / 7"
)
TABLE = "create table t (i int primary key, v text, d date, ts timestamptz, n numeric)"


@pytest.fixture(params=["psql", "relay"])
def path(request, monkeypatch):
    if request.param == "relay":
        monkeypatch.setattr(copystream, "psql_binary", lambda: None)
    else:
        assert copystream.psql_binary() is not None
    return request.param


def copy_into(prov, sub, query: str) -> tuple[int, int]:
    """copystream.stream_copy of query into sub's t, committed; the provider's snapshot exported
    from a transaction held meanwhile, as the copy process does."""
    with prov.connect(autocommit=False) as holder, sub.connect(autocommit=False) as conn:
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        snapshot = copystream.export_snapshot(holder)
        out = sql.SQL("copy ({}) to stdout").format(sql.SQL(query))
        got = copystream.stream_copy(prov.connstr, snapshot, out, conn, sql.SQL("copy t from stdin"))
        conn.commit()
        return got


def test_rows_arrive_whatever_each_side_datestyle(make_db, path):
    prov, sub = make_db("a"), make_db("b")
    for db, style in ((prov, "SQL, DMY"), (sub, "SQL, MDY")):
        with db.connect() as conn:
            conn.execute(
                sql.SQL("alter database {} set datestyle = {}").format(
                    sql.Identifier(db.name), sql.Literal(style)
                )
            )
            conn.execute(
                sql.SQL("alter database {} set timezone = 'America/New_York'").format(sql.Identifier(db.name))
            )
            conn.execute(TABLE)
    with prov.connect() as conn:
        conn.execute(f"insert into t {ROWS % 'i'} from generate_series(1, 20000) i")
    rows, moved = copy_into(prov, sub, "select * from t")
    assert rows == 20000 and moved > 0
    digest = "select md5(string_agg(format('%s|%s|%s|%s|%s', i, v, to_char(d, 'YYYY-MM-DD'), extract(epoch from ts), n), ',' order by i)) from t"
    assert prov.scalar(digest) == sub.scalar(digest)


def test_a_provider_failing_part_way_fails_the_copy(make_db, path):
    prov, sub = make_db("a"), make_db("b")
    with sub.connect() as conn:
        conn.execute(TABLE)
    # 300k rows stream out before row 300001 divides by zero: more than a write's worth
    failing = f"{ROWS % '1 / (300001 - i)'} from generate_series(1, 400000) i"
    with pytest.raises((RuntimeFailure, psycopg.Error), match="division by zero"):
        copy_into(prov, sub, failing)
    assert sub.scalar("select count(*) from t") == 0


def test_the_password_stays_off_the_command_line():
    cmd, env = copystream.psql_command(
        "psql", "host=db1 port=5433 user=rep password=s3cr'et dbname=app", "00000003-1", "copy t to stdout"
    )
    assert not any("s3cr" in arg for arg in cmd)
    assert env["PGPASSWORD"] == "s3cr'et"
    assert "host=db1" in cmd[-1] and "dbname=app" in cmd[-1]
