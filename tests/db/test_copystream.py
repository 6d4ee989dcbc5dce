"""The COPY stream between two databases (copystream.py): psql on the provider's side, or the
psycopg relay where no psql is found.  Real clusters; the provider fails part-way through."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from pgcascade.core import copystream, roundtrip
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


def test_a_batch_relay_moves_every_row_and_a_failure_on_either_side_leaves_nothing(make_db):
    """roundtrip.relay_copy, the batch's stream into the staging table: libpq's own calls.
    Rows equal on both sides; the source failing part-way (row 7,000 of 20,000) or the
    destination refusing a row raises that error, nothing of the stream stays in the
    destination's transaction, and both connections go on working."""
    prov, sub = make_db(), make_db()
    with sub.connect() as c:
        c.execute(TABLE)
    rows = ROWS % "i"
    with prov.connect() as p, sub.connect(autocommit=False) as s:
        moved = roundtrip.relay_copy(
            p, f"copy ({rows} from generate_series(1, 20000) i) to stdout".encode(), s, b"copy t from stdin"
        )
        s.commit()
        assert moved > 20000 * 30
        for bad_out, bad_in, error in [
            ("1 / (27000 - i)", "i", psycopg.errors.DivisionByZero),
            ("i", "case when i = 27000 then 'x' else i::text end", psycopg.errors.InvalidTextRepresentation),
        ]:
            query = f"copy (select {bad_in}, v, d, ts, n + {bad_out} from ({rows} from generate_series(20001, 40000) i) r(i, v, d, ts, n)) to stdout"
            s.execute("select 1")  # in a transaction, as the worker's batch
            with pytest.raises(error):
                roundtrip.relay_copy(p, query.encode(), s, b"copy t from stdin")
            assert s.info.transaction_status == psycopg.pq.TransactionStatus.INERROR  # no commit of a part
            s.rollback()
            assert p.execute("select 1").fetchone() == (1,)
        assert s.execute("select count(*) from t").fetchone() == (20000,)
    with prov.connect() as p, sub.connect() as s:
        want = p.execute(f"{rows} from generate_series(1, 20000) i order by 1").fetchall()
        assert s.execute("select * from t order by i").fetchall() == want
