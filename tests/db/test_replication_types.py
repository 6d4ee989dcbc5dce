"""Table replication end to end, by what the rows hold: every built-in type, NULLs, odd text,
a 10 MB value, keys that are not unique indexes on the subscriber, swaps under a secondary
UNIQUE constraint, identifiers that need quoting, TRUNCATE, and a destination table of another name.

Each test runs a real root and leaf (two clusters), the CLI and the daemons as processes, and
compares the tables with a checksum PostgreSQL computes over every row's text on each side.
"""

from __future__ import annotations

import psycopg
import pytest
from conftest import TEXT_SETTINGS, table_checksum


def run(db, *statements: str) -> None:
    with db.connect() as conn:
        for s in statements:
            conn.execute(s)


def rows(db, query: str, params: tuple | None = None) -> list[tuple]:
    with db.connect() as conn:
        conn.execute(TEXT_SETTINGS)
        return conn.execute(query, params).fetchall()


# --- every type ------------------------------------------------------------------------------------

TYPES_DDL = [
    "create type mood as enum ('sad', 'ok', 'happy', 'it''s \"quoted\", too')",
    "create domain short_text as text check (length(value) < 1000)",
    "create type pair as (a int, b text, c numeric[])",
]

COLUMNS = {
    "c_int2": "int2",
    "c_int4": "int4",
    "c_int8": "int8",
    "c_num": "numeric",
    "c_num102": "numeric(10,2)",
    "c_f4": "float4",
    "c_f8": "float8",
    "c_bool": "bool",
    "c_text": "text",
    "c_vc": "varchar(20)",
    "c_ch": "char(5)",
    "c_char1": '"char"',
    "c_name": "name",
    "c_bytea": "bytea",
    "c_date": "date",
    "c_time": "time",
    "c_timetz": "timetz",
    "c_ts": "timestamp",
    "c_ts3": "timestamp(3)",
    "c_tstz": "timestamptz",
    "c_iv": "interval",
    "c_uuid": "uuid",
    "c_json": "json",
    "c_jsonb": "jsonb",
    "c_inet": "inet",
    "c_cidr": "cidr",
    "c_mac": "macaddr",
    "c_mac8": "macaddr8",
    "c_money": "money",
    "c_bit": "bit(8)",
    "c_varbit": "varbit",
    "c_point": "point",
    "c_box": "box",
    "c_lseg": "lseg",
    "c_path": "path",
    "c_polygon": "polygon",
    "c_circle": "circle",
    "c_range": "int4range",
    "c_numrange": "numrange",
    "c_tsrange": "tstzrange",
    "c_tsv": "tsvector",
    "c_tsq": "tsquery",
    "c_xml": "xml",
    "c_oid": "oid",
    "c_lsn": "pg_lsn",
    "c_ia": "int[]",
    "c_ta": "text[]",
    "c_ia2": "int[][]",
    "c_tstza": "timestamptz[]",
    "c_jsonba": "jsonb[]",
    "c_enum": "mood",
    "c_enuma": "mood[]",
    "c_dom": "short_text",
    "c_comp": "pair",
    "c_compa": "pair[]",
}

NASTY_TEXT = (
    "E'single '' double \" backslash \\\\ \\\\x00 newline \\n tab \\t cr \\r "
    "emoji \U0001f600\U0001f469\u200d\U0001f469\u200d\U0001f467 RTL \u05e9\u05dc\u05d5\u05dd "
    "\u0645\u0631\u062d\u0628\u0627 combining e\u0301 a\u0308 zero-width \u200b end'"
)

# Rows as {column: SQL literal}; columns left out are NULL.
ROWS: list[dict[str, str]] = [
    {  # ordinary values
        "c_int2": "12",
        "c_int4": "123456",
        "c_int8": "1234567890123",
        "c_num": "3.14159265358979323846264338327950288419716939937510",
        "c_num102": "12345678.90",
        "c_f4": "1.5",
        "c_f8": "0.1",
        "c_bool": "true",
        "c_text": "'hello'",
        "c_vc": "'varchar'",
        "c_ch": "'ab'",
        "c_char1": "'x'",
        "c_name": "'a name'",
        "c_bytea": "'\\x00ff0001'::bytea",
        "c_date": "'2024-02-29'",
        "c_time": "'23:59:59.999999'",
        "c_timetz": "'12:34:56.5+05:30'",
        "c_ts": "'2024-02-29 12:34:56.123456'",
        "c_ts3": "'2024-02-29 12:34:56.123'",
        "c_tstz": "'2024-02-29 12:34:56.123456+02'",
        "c_iv": "'1 year 2 mons 3 days 04:05:06.789'",
        "c_uuid": "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'",
        "c_json": """'{"b": 1,   "a": [1, 2.50, "x"],  "a": null}'""",
        "c_jsonb": """'{"k": [1, {"n": null}], "e": "\U0001f600", "q": "a\\"b", "big": 1.000000000000000000001}'""",
        "c_inet": "'192.168.1.5/24'",
        "c_cidr": "'10.1.0.0/16'",
        "c_mac": "'08:00:2b:01:02:03'",
        "c_mac8": "'08:00:2b:01:02:03:04:05'",
        "c_money": "12.34",
        "c_bit": "B'10101010'",
        "c_varbit": "B'101'",
        "c_point": "'(1.5,-2.25)'",
        "c_box": "'((0,0),(1,1))'",
        "c_lseg": "'[(0,0),(1,2)]'",
        "c_path": "'[(0,0),(1,1),(2,0)]'",
        "c_polygon": "'((0,0),(1,1),(1,0))'",
        "c_circle": "'<(1,1),5>'",
        "c_range": "'[1,10)'",
        "c_numrange": "'(1.5,2.5]'",
        "c_tsrange": "'[2024-01-01 00:00+00,infinity)'",
        "c_tsv": "'a fat cat:3A sat:1,4 ''it''''s'''",
        "c_tsq": "'fat & (rat | !cat:*)'",
        "c_xml": """'<a x="1">text &amp; more <b/></a>'""",
        "c_oid": "4294967295",
        "c_lsn": "'16/B374D848'",
        "c_ia": "'{1,2,3}'",
        "c_ta": """ARRAY['a', NULL, 'with, comma', 'with "dq"', 'with ''sq''', 'NULL', '', '{brace}', 'back\\slash']""",
        "c_ia2": "'{{1,2},{3,4},{5,NULL}}'",
        "c_tstza": "ARRAY['2024-01-01 00:00:00+00'::timestamptz, '-infinity', NULL]",
        "c_jsonba": """ARRAY['{"a": 1}'::jsonb, '[null]', '"s"', NULL]""",
        "c_enum": "'happy'",
        "c_enuma": """ARRAY['sad', 'it''s "quoted", too']::mood[]""",
        "c_dom": "'domain text'",
        "c_comp": """ROW(1, 'a "b", (c)', '{1.5,NULL}')::pair""",
        "c_compa": """ARRAY[ROW(1, 'x', NULL)::pair, ROW(NULL, NULL, NULL)::pair, NULL]""",
    },
    {  # extremes
        "c_int2": "-32768",
        "c_int4": "-2147483648",
        "c_int8": "9223372036854775807",
        "c_num": "'123456789012345678901234567890123456789012345678901234567890.000000000000000000000000000000000000000001000'",
        "c_num102": "-99999999.99",
        "c_f4": "'Infinity'",
        "c_f8": "'-Infinity'",
        "c_bool": "false",
        "c_text": "''",
        "c_vc": "''",
        "c_ch": "'abcde'",
        "c_bytea": "''::bytea",
        "c_date": "'infinity'",
        "c_time": "'00:00'",
        "c_timetz": "'00:00:00-12'",
        "c_ts": "'-infinity'",
        "c_tstz": "'infinity'",
        "c_iv": "'-1 days +02:03:04'",
        "c_uuid": "'00000000-0000-0000-0000-000000000000'",
        "c_json": "'\"just a string\"'",
        "c_jsonb": "'[]'",
        "c_inet": "'::ffff:1.2.3.4'",
        "c_cidr": "'2001:db8::/32'",
        "c_money": "-92233720368547758.08",
        "c_bit": "B'00000000'",
        "c_varbit": "B''",
        "c_range": "'empty'",
        "c_numrange": "'(,)'",
        "c_oid": "0",
        "c_ia": "'{}'",
        "c_ta": "'{}'",
        "c_enum": "'it''s \"quoted\", too'",
        "c_dom": "''",
        "c_comp": "ROW(NULL, NULL, NULL)::pair",
        "c_compa": "'{}'",
    },
    {  # not-a-number and small numbers
        "c_num": "'NaN'",
        "c_num102": "0.01",
        "c_f4": "'NaN'",
        "c_f8": "'NaN'",
        "c_date": "'0044-03-15 BC'",
        "c_ts": "'0044-03-15 12:00:00 BC'",
        "c_tstz": "'-infinity'",
        "c_iv": "'0'",
        "c_json": "'[null, \"null\"]'",
        "c_jsonb": "'\"\"'",
        "c_text": "'NULL'",
        "c_ta": "ARRAY[NULL, NULL]::text[]",
    },
    {  # more numbers
        "c_num": "'-0.000000000000000000000000000000000000000000000000000000000000000000000000000000000001'",
        "c_f4": "3.4028235e38",
        "c_f8": "2.2250738585072014e-308",
        "c_int8": "-9223372036854775808",
        "c_iv": "'178000000 years'",
    },
    {  # infinite numeric, smallest subnormal double, float4 precision
        "c_num": "'Infinity'",
        "c_f4": "1.17549435e-38",
        "c_f8": "4.9e-324",
        "c_text": NASTY_TEXT,
        "c_vc": "'\u00e9t\u00e9 \U0001f600'",
        "c_ch": "'\u00e9 '",
        "c_name": "'\u00e9\U0001f600'",
        "c_dom": NASTY_TEXT,
        "c_json": """'{"text": "\\\\u00e9 \\" \\\\\\\\ \\n"}'""",
        "c_xml": "'<r>\u05e9\u05dc\u05d5\u05dd &lt;&gt;</r>'",
        "c_ta": f"ARRAY[{NASTY_TEXT}, '\"', '\\\\', ',', '{{', '}}', ' lead and trail ']",
        "c_comp": f"ROW(-1, {NASTY_TEXT}, '{{}}')::pair",
        "c_bytea": "'\\x00000a0d5c27225c'::bytea",
    },
    {},  # NULL in every column
    {  # JSON null in the json columns (not SQL NULL)
        "c_json": "'null'",
        "c_jsonb": "'null'",
        "c_text": "'json nulls'",
    },
    {  # NULL in every column but the text, as the string 'null' and friends
        "c_text": "'null'",
        "c_vc": "'NULL'",
        "c_json": "'{}'",
        "c_jsonb": "'{}'",
    },
]
NEG_ZERO = {"c_f4": "'-0'", "c_f8": "'-0'", "c_num": "'-0'"}  # float -0 must stay -0


def create_alltypes(db, table: str) -> None:
    cols = ", ".join(f"{c} {t}" for c, t in COLUMNS.items())
    run(db, f"create table {table} (id int primary key, {cols})")


def insert_rows(conn: psycopg.Connection, table: str, rows_: list[dict[str, str]], first_id: int) -> None:
    for i, r in enumerate(rows_):
        if r:
            cols = ", ".join(["id", *r])
            vals = ", ".join([str(first_id + i), *r.values()])
            conn.execute(f"insert into {table} ({cols}) values ({vals})")
        else:
            conn.execute(f"insert into {table} (id) values ({first_id + i})")


def exercise_alltypes(replica, table: str, big: bool) -> None:
    """Rows copied, then inserted, updated (also their keys, also many rows at once) and
    deleted while the worker runs; both sides must end equal."""
    with replica.root.connect() as conn:
        insert_rows(conn, table, [*ROWS, NEG_ZERO], 1)  # these go through the initial copy
    replica.cli("root", "add-table", table, *(["--format=sql"] if not big else []))
    replica.cli("leaf", "add-table", table, "--create")
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    replica.assert_equal(table)

    with replica.root.connect() as conn:
        # single-row inserts of every value: the event path
        insert_rows(conn, table, [*ROWS, NEG_ZERO], 100)
        # a multi-row insert copying every row
        conn.execute(f"insert into {table} select id + 200, {', '.join(COLUMNS)} from {table} where id < 100")
        # a multi-row update of every column with the values of other rows
        conn.execute(
            f"update {table} t set ({', '.join(COLUMNS)}) = (select {', '.join('s.' + c for c in COLUMNS)}"
            f" from {table} s where s.id = 100 + (t.id - 200 + 1) % {len(ROWS) + 1})"
            f" where t.id >= 200"
        )
        # key changes: one row, and many rows in one statement
        conn.execute(f"update {table} set id = 1000 where id = 101")
        conn.execute(f"update {table} set id = id + 1000 where id between 200 and 203")
        # a key change and a value change in one statement, in one transaction with more
        with conn.transaction():
            conn.execute(
                f"update {table} set id = -id, c_text = 'moved ' || coalesce(c_text, '') where id in (1, 2)"
            )
            conn.execute(f"update {table} set id = -id where id in (-1, -2)")
            conn.execute(f"delete from {table} where id in (102, 205)")
            conn.execute(f"insert into {table} (id, c_text) values (102, 'back again')")
            conn.execute(f"update {table} set c_int4 = c_int4 + 1, c_ia = c_ia || 9 where id < 1000")
        conn.execute(f"delete from {table} where id between 104 and 105")
        conn.execute(f"update {table} set c_text = null, c_comp = null where id = 3")
        if big:
            # one row over 10 MB through the queue, then changed again
            conn.execute(
                f"insert into {table} (id, c_text, c_bytea) values (5000,"
                " repeat(md5('x') || E'\\n\\u00e9\\\\\"', 300000), decode(repeat('00ff', 10), 'hex'))"
            )
            conn.execute(f"update {table} set c_text = c_text || 'tail', c_int2 = 1 where id = 5000")
    replica.wait_sync()
    if big:
        size = replica.leaf.scalar(f"select octet_length(c_text) from {table} where id = 5000")
        assert size > 10 * 1024 * 1024
    # the same values on both sides, column by column (the checksum would hide nothing, but
    # this names the column that differs)
    differ = {}
    for col in COLUMNS:
        q = f"select id, {col}::text from {table} order by id"
        root_rows, leaf_rows = rows(replica.root, q), rows(replica.leaf, q)
        if root_rows != leaf_rows:
            differ[col] = [(r, lf) for r, lf in zip(root_rows, leaf_rows, strict=True) if r != lf][:3]
    assert differ == {}, "\n".join(f"{k}: {v}" for k, v in differ.items())
    replica.assert_equal(table)
    # -0 survives as -0 (its text is '-0')
    neg = rows(
        replica.leaf,
        f"select c_f4::text, c_f8::text from {table} where id in ({1 + len(ROWS)}, {100 + len(ROWS)})",
    )
    assert neg == [("-0", "-0"), ("-0", "-0")]


@pytest.mark.parametrize("fmt", ["json", "sql"])
def test_every_type_round_trips(replica, fmt):
    for db in (replica.root, replica.leaf):
        run(db, *TYPES_DDL)
    create_alltypes(replica.root, "public.alltypes")
    replica.setup()
    exercise_alltypes(replica, "public.alltypes", big=(fmt == "json"))
    ev_format = replica.root.scalar("select event_format from pgcascade.set_table")
    assert ev_format == fmt


ODD_SETTINGS = (
    "set datestyle = 'SQL, DMY'",
    "set intervalstyle = 'sql_standard'",
    "set extra_float_digits = 0",
    "set bytea_output = 'escape'",
    "set timezone = 'Asia/Kathmandu'",
)


@pytest.mark.parametrize("fmt", ["json", "sql"])
def test_session_settings_of_the_writer_do_not_change_values(replica, fmt):
    """The root's applications may write with any DateStyle, IntervalStyle, extra_float_digits,
    bytea_output and TimeZone: the values the leaf stores are the same."""
    run(
        replica.root,
        "create table public.s (id int primary key, d date, ts timestamp, tstz timestamptz, iv interval,"
        " f8 float8, f4 float4, b bytea, tsa timestamp[], r tsrange)",
    )
    replica.setup()
    replica.cli("root", "add-table", "public.s", f"--format={fmt}")
    replica.cli("leaf", "add-table", "public.s", "--create")
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    values = (
        "'2024-01-02', '2024-01-02 03:04:05.678901', '2024-01-02 03:04:05.678901+00',"
        " '1 year -2 mons 3 days -04:05:06.7', 0.1::float8 + 0.2, 0.1::float4 * 3, '\\x00ff5c27'::bytea,"
        " array['2024-12-31 23:59:59'::timestamp], '[2024-01-02 03:04, 2024-01-03)'"
    )
    with replica.root.connect() as conn:
        for s in ODD_SETTINGS:
            conn.execute(s)
        conn.execute(f"insert into public.s values (1, {values}), (2, {values})")
        conn.execute("update public.s set f8 = f8 * 3, iv = iv * 2 where id = 2")
        conn.execute("delete from public.s where id = 1 and d = '02/01/2024'")  # DMY: 2 January
        conn.execute(f"insert into public.s values (3, {values})")
    replica.wait_sync()
    q = "select id, d::text, ts::text, tstz::text, iv::text, f8::text, f4::text, b::text, tsa::text, r::text from public.s order by id"
    assert rows(replica.leaf, q) == rows(replica.root, q)
    replica.assert_equal("public.s")
    assert rows(replica.leaf, "select id, d::text, f8::text from public.s order by id") == [
        (2, "2024-01-02", "0.9000000000000001"),
        (3, "2024-01-02", "0.30000000000000004"),
    ]


def test_json_null_in_a_json_column_stays_json_null(replica):
    """row_to_json writes JSON null and SQL NULL alike: the images mark the first, so a jsonb
    'null' in a NOT NULL column arrives as itself, by every apply path."""
    ddl = [
        "create domain jdom as jsonb",
        "create table public.j (id int primary key, j jsonb not null, js json, d jdom, t text)",
        "create table public.jrow (id int primary key, j jsonb, js json)",  # applied row by row
    ]
    run(replica.root, *ddl)
    run(replica.leaf, *ddl[:1])
    run(replica.leaf, "create table public.jrow (id int not null, j jsonb, js json)")
    with replica.root.connect() as conn:
        conn.execute(
            "insert into public.j values (1, 'null', 'null', 'null', 'null'), (2, '{}', null, null, null)"
        )
    replica.setup()
    replica.cli("root", "add-table", "public.j", "public.jrow")
    replica.cli("leaf", "add-table", "public.j", "--create")
    replica.cli("leaf", "add-table", "public.jrow")
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    with replica.root.connect() as conn:
        conn.execute(
            "insert into public.j values (3, 'null', 'null', 'null', null), (4, '[null]', '{\"a\": null}', null, 'x')"
        )
        conn.execute("update public.j set j = '1', js = null, d = null where id = 1")
        conn.execute("update public.j set j = 'null', js = 'null', d = 'null' where id = 2")
        conn.execute("insert into public.jrow values (1, 'null', 'null'), (2, null, null), (3, '{}', 'null')")
        conn.execute("update public.jrow set j = null, js = null where id = 1")
        conn.execute("update public.jrow set j = 'null' where id = 2")
    replica.wait_sync()
    for table in ("public.j", "public.jrow"):
        q = f"select id, j::text, j is null, js::text, js is null from {table} order by id"
        assert rows(replica.root, q) == rows(replica.leaf, q), table
    assert rows(replica.leaf, "select d::text, d is null from public.j where id = 2") == [("null", False)]


# --- keys without a unique index, secondary unique constraints ---------------------------------------------


def test_subscriber_without_a_unique_index_on_the_key(replica):
    # nokey: no primary key on the root (its key is given with --key), none on the leaf: applied
    # row by row; pkroot: a primary key on the root, a leaf table made by hand without any
    # index: set-based, as update-then-insert (the root's key is unique)
    run(
        replica.root,
        "create table public.nokey (a int not null, b text not null, v text, n int)",
        "create table public.pkroot (id int primary key, v text)",
        "insert into public.nokey select i % 7, 'b' || i, 'v' || i, i from generate_series(1, 50) i",
        "insert into public.pkroot select i, 'v' || i from generate_series(1, 50) i",
    )
    run(
        replica.leaf,
        "create table public.nokey (a int not null, b text not null, v text, n int)",
        "create table public.pkroot (id int not null, v text)",
    )
    replica.setup()
    replica.cli("root", "add-table", "public.nokey", "--key=a,b")
    replica.cli("root", "add-table", "public.pkroot")
    replica.cli("leaf", "add-table", "public.nokey", "public.pkroot")
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    replica.assert_equal("public.nokey", "public.pkroot")
    with replica.root.connect() as conn:
        conn.execute("insert into public.nokey select 100 + i, 'new', 'x', i from generate_series(1, 20) i")
        conn.execute("update public.nokey set v = v || '!', n = n * 2 where a < 3")
        conn.execute("update public.nokey set a = a + 1000 where b in ('b1', 'b2', 'b3')")  # key change
        conn.execute("delete from public.nokey where a = 4")
        conn.execute("insert into public.pkroot select i, 'new' from generate_series(51, 70) i")
        with conn.transaction():
            conn.execute("update public.pkroot set id = id + 1000 where id <= 5")
            conn.execute("update public.pkroot set v = 'again' where id > 1000")
            conn.execute("insert into public.pkroot values (1, 'reused key')")
        conn.execute("delete from public.pkroot where id between 10 and 20")
    replica.wait_sync()
    replica.assert_equal("public.nokey", "public.pkroot")
    assert replica.leaf.scalar("select count(*) from public.nokey where a >= 1000") == 3


def test_swapping_values_of_a_secondary_unique_constraint(replica):
    run(
        replica.root,
        "create table public.u (id int primary key, u int not null unique, v text)",
        "create table public.ud (id int primary key, u int not null, v text,"
        " constraint ud_u unique (u) deferrable)",
        "insert into public.u select i, i, 'v' from generate_series(1, 20) i",
        "insert into public.ud select i, i, 'v' from generate_series(1, 20) i",
    )
    # the leaf has the same unique constraints (created by hand: --create makes only the key)
    run(
        replica.leaf,
        "create table public.u (id int primary key, u int not null unique, v text)",
        "create table public.ud (id int primary key, u int not null, v text,"
        " constraint ud_u unique (u) deferrable)",
    )
    replica.setup(["public.u", "public.ud"], leaf_args=())
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    with replica.root.connect() as conn:
        with conn.transaction():  # a swap through a free value, and a rotation of three
            conn.execute("update public.u set u = -1 where id = 1")
            conn.execute("update public.u set u = 1 where id = 2")
            conn.execute("update public.u set u = 2 where id = 1")
            conn.execute("update public.u set u = -3 where id = 3")
            conn.execute("update public.u set u = 3 where id = 4")
            conn.execute("update public.u set u = 4 where id = 5")
            conn.execute("update public.u set u = 5 where id = 3")
            conn.execute("update public.u set v = 'changed' where id > 10")
            # another table in the same batch: applied together with u's statement, which fails
            conn.execute("update public.ud set v = 'same batch' where id > 15")
        # a deferrable constraint lets one statement swap
        conn.execute("update public.ud set u = case id when 1 then 2 when 2 then 1 end where id in (1, 2)")
        with conn.transaction():
            conn.execute("set constraints all deferred")
            conn.execute("update public.ud set u = u + 1 where id between 5 and 9")
            conn.execute("update public.ud set u = 5 where id = 9")
    replica.wait_sync()
    replica.assert_equal("public.u", "public.ud")
    assert "public.u: set-based apply hit UniqueViolation; applying row by row" in replica.log()
    assert rows(replica.leaf, "select id, u from public.u where id <= 5 order by id") == [
        (1, 2),
        (2, 1),
        (3, 5),
        (4, 3),
        (5, 4),
    ]
    assert "applying row by row" in replica.log("leaf")


# --- identifiers ---------------------------------------------------------------------------------------


def qi(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


SCHEMA = 'My "Sch.ema" \u00fc \U0001f600'
TABLE_JSON = 'Tab le."x" \u00e9'
TABLE_SQL = "Tab\u00e9 SQL.'s'"
ODD_COLUMNS = ["Id", 'col "q"', "a.b", "\u00fcn\u00ef \u00e7\u00f8d\u00e9", "select", "n", "o", "with'quote"]


def test_identifiers_with_capitals_spaces_quotes_dots_and_unicode(replica):
    cols = ", ".join(f"{qi(c)} text" for c in ODD_COLUMNS[1:])
    for t in (TABLE_JSON, TABLE_SQL):
        run(
            replica.root,
            f"create schema if not exists {qi(SCHEMA)}",
            f"create table {qi(SCHEMA)}.{qi(t)} ({qi('Id')} int, {cols}, primary key ({qi('Id')}, {qi('a.b')}))",
            f"insert into {qi(SCHEMA)}.{qi(t)} select i, 'q' || i, 'ab' || (i % 3), 'u', 'sel', 'n', 'o', 'w'"
            " from generate_series(1, 30) i",
        )
    replica.setup()
    names = [f"{qi(SCHEMA)}.{qi(t)}" for t in (TABLE_JSON, TABLE_SQL)]
    out = replica.cli("root", "add-table", names[0]).stdout
    assert out.strip() == f"added {names[0]}"
    replica.cli("root", "add-table", names[1], "--format=sql")
    out = replica.cli("leaf", "add-table", *names, "--create").stdout
    assert sorted(out.strip().splitlines()) == sorted(f"added {n}" for n in names)
    listed = replica.cli("leaf", "tables").stdout
    for n in names:
        assert n in listed
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    replica.assert_equal(*names)
    for n in names:
        with replica.root.connect() as conn:
            conn.execute(
                f"insert into {n} ({qi('Id')}, {qi('a.b')}, {qi('select')}) values (100, 'x', 'new')"
            )
            conn.execute(
                f"update {n} set {qi(ODD_COLUMNS[1])} = 'it''s \"q\"', n = null where {qi('Id')} < 10"
            )
            conn.execute(f"update {n} set {qi('Id')} = {qi('Id')} + 1000 where {qi('Id')} between 10 and 12")
            conn.execute(f"delete from {n} where {qi('a.b')} = 'ab2'")
            if n == names[1]:
                conn.execute(f"truncate {n}")
            conn.execute(f"insert into {n} ({qi('Id')}, {qi('a.b')}) values (7, 'after truncate')")
    replica.wait_sync()
    replica.assert_equal(*names)
    assert replica.leaf.scalar(f"select count(*) from {names[1]}") == 1
    # remove-table with the quoted name, on both sides
    assert replica.cli("leaf", "remove-table", names[0]).stdout.strip() == f"removed {names[0]}"
    assert replica.cli("root", "remove-table", names[0]).stdout.strip() == f"removed {names[0]}"


def test_globs_all_and_bare_names_mean_public(replica):
    for db in (replica.root, replica.leaf):
        run(
            db,
            "create schema shadow",
            "create table public.part1 (id int primary key, v text)",
            "create table public.part2 (id int primary key, v text)",
            "create table public.partition_me (id int primary key, v text) partition by range (id)",
            "create table public.partition_me_a partition of public.partition_me for values from (0) to (100)",
            "create table public.partition_me_b partition of public.partition_me for values from (100) to (1000)",
            "create table public.other (id int primary key, v text)",
            "create table public.samename (id int primary key, v text)",
            "create table shadow.samename (id int primary key, v text)",
            f"alter database {db.name} set search_path = shadow, public",
        )
    with replica.root.connect() as conn:
        for t in ("public.part1", "public.part2", "public.partition_me", "public.other", "public.samename"):
            conn.execute(f"insert into {t} select i, '{t}' from generate_series(1, 150) i")
        conn.execute("insert into shadow.samename select i, 'shadow' from generate_series(1, 7) i")
    replica.setup()
    out = replica.cli("root", "add-table", "public.part*").stdout.split()
    assert out[1::2] == ["public.part1", "public.part2", "public.partition_me"]
    out = replica.cli("root", "add-table", "samename").stdout  # public.samename, not shadow's
    assert out.strip() == "added public.samename"
    # --all on the root adds what is left, partitions stay out (their parent has them)
    out = replica.cli("root", "add-table", "--all").stdout
    assert out.split()[1::2] == ["public.other", "shadow.samename"]
    tables = replica.cli("root", "tables").stdout
    assert "partition_me_a" not in tables
    replica.cli("root", "remove-table", "shadow.samename")
    # the leaf: a bare name is public's too, then --all takes the rest of the set
    assert replica.cli("leaf", "add-table", "samename").stdout.strip() == "added public.samename"
    out = replica.cli("leaf", "add-table", "--all").stdout
    assert out.split()[1::2] == ["public.other", "public.part1", "public.part2", "public.partition_me"]
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    with replica.root.connect() as conn:
        for t in ("public.part1", "public.partition_me", "public.samename"):
            conn.execute(f"update {t} set v = v || ' changed' where id % 2 = 0")
            conn.execute(f"delete from {t} where id % 5 = 0")
            conn.execute(f"insert into {t} select i, 'new' from generate_series(500, 510) i")
        conn.execute("update public.partition_me set id = id + 700 where id < 10")  # moves between partitions
        conn.execute("insert into shadow.samename values (100, 'not replicated')")
    replica.wait_sync()
    replica.assert_equal(
        "public.part1", "public.part2", "public.partition_me", "public.other", "public.samename"
    )
    assert table_checksum(replica.leaf, "public.partition_me")[0] > 100
    assert replica.leaf.scalar("select count(*) from shadow.samename") == 0
    assert replica.leaf.scalar("select count(*) from public.samename where v = 'shadow'") == 0


# --- TRUNCATE and destination tables -------------------------------------------------------------------


TRUNCATE_DDL = [
    "create table public.ta (id int primary key, v text)",
    "create table public.tb (id int primary key, v text)",
    "create table public.parent (id int primary key, v text)",
    "create table public.child (id int primary key, parent_id int not null references public.parent, v text)",
]


def fill_truncate_tables(conn: psycopg.Connection, start: int) -> None:
    for t in ("public.ta", "public.tb", "public.parent"):
        conn.execute(f"insert into {t} select i, 'v' || i from generate_series({start}, {start + 19}) i")
    conn.execute(
        f"insert into public.child select i, i, 'c' || i from generate_series({start}, {start + 19}) i"
    )


def test_truncate_is_replicated(replica):
    run(replica.root, *TRUNCATE_DDL)
    run(replica.leaf, *TRUNCATE_DDL)  # with the foreign key on the leaf too
    with replica.root.connect() as conn:
        fill_truncate_tables(conn, 1)
    tables = ["public.ta", "public.tb", "public.parent", "public.child"]
    replica.setup(tables, leaf_args=())
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    replica.assert_equal(*tables)

    def counts() -> list[int]:
        return [replica.leaf.scalar(f"select count(*) from {t}") for t in tables]

    run(replica.root, "truncate public.ta")
    replica.wait_sync()
    replica.assert_equal(*tables)
    assert counts() == [0, 20, 20, 20]

    with replica.root.connect() as conn:
        conn.execute("insert into public.ta select i, 'again' from generate_series(1, 5) i")
        conn.execute("truncate public.ta, public.tb")  # two tables in one statement
        conn.execute("insert into public.tb values (1, 'after the truncate')")
    replica.wait_sync()
    replica.assert_equal(*tables)
    assert counts() == [0, 1, 20, 20]

    run(replica.root, "truncate public.parent cascade")  # the child goes too
    replica.wait_sync()
    replica.assert_equal(*tables)
    assert counts() == [0, 1, 0, 0]

    with replica.root.connect() as conn, conn.transaction():  # rows, truncate, rows in one batch
        fill_truncate_tables(conn, 100)
        conn.execute("truncate public.child, public.parent")
        fill_truncate_tables(conn, 200)
        conn.execute("delete from public.child where id > 210")
        conn.execute("truncate public.ta")
    replica.wait_sync()
    replica.assert_equal(*tables)
    assert counts() == [0, 41, 20, 11]


def test_dest_table_another_name_in_another_schema(replica):
    run(
        replica.root,
        "create table public.src (id int primary key, v text, n numeric)",
        "insert into public.src select i, 'v' || i, i / 3.0 from generate_series(1, 100) i",
    )
    replica.setup()
    replica.cli("root", "add-table", "public.src")
    out = replica.cli("leaf", "add-table", "public.src", "--dest-table", "other.dst", "--create").stdout
    assert out.strip() == "added public.src"
    assert replica.cli("leaf", "tables").stdout.split() == ["public.src", "->", "other.dst", "NULL"]
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    assert replica.cli("leaf", "tables").stdout.split() == ["public.src", "->", "other.dst", "ok"]
    with replica.root.connect() as conn:
        conn.execute("update public.src set v = 'changed' where id % 3 = 0")
        conn.execute("update public.src set id = -id where id < 5")
        conn.execute("delete from public.src where id between 50 and 60")
        conn.execute("insert into public.src values (1000, 'new', 1e10)")
    replica.wait_sync()
    assert table_checksum(replica.root, "public.src") == table_checksum(replica.leaf, "other.dst")
    assert replica.leaf.scalar("select to_regclass('public.src')") is None
    run(replica.root, "truncate public.src")
    replica.wait_sync()
    assert replica.leaf.scalar("select count(*) from other.dst") == 0


ODD_DEFAULTS = {  # what a server's or role's defaults may be; none may change a replicated value
    "root": {
        "datestyle": "SQL, DMY",
        "intervalstyle": "sql_standard",
        "timezone": "America/New_York",
        "extra_float_digits": "-3",
        "bytea_output": "escape",
    },
    "leaf": {
        "datestyle": "German, MDY",
        "intervalstyle": "postgres_verbose",
        "timezone": "Asia/Kolkata",
        "extra_float_digits": "0",
        "bytea_output": "escape",
    },
}


def test_every_type_round_trips_whatever_each_side_settings(replica):
    """Root and leaf databases with different, unusual DateStyle, IntervalStyle, time zone,
    float digits and bytea output: the copy, the capture and the worker's event stream carry
    every value unchanged."""
    for name, db in (("root", replica.root), ("leaf", replica.leaf)):
        run(db, *TYPES_DDL)
        for k, v in ODD_DEFAULTS[name].items():
            run(db, f"alter database {db.name} set {k} = '{v}'")
    create_alltypes(replica.root, "public.alltypes")
    replica.setup()
    exercise_alltypes(replica, "public.alltypes", big=False)
