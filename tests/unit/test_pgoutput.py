"""pgoutput decoding and the capture daemon's handling of row messages, from crafted bytes."""

import struct
from pathlib import Path

import pytest

from pgcascade.capture.daemon import WalCapture
from pgcascade.capture.pgoutput import UNCHANGED, Reader, Relation, lsn_int, lsn_str
from pgcascade.core.config import JobConfig
from pgcascade.core.errors import RuntimeFailure


def tuple_data(*values):
    out = struct.pack(">H", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is UNCHANGED:
            out += b"u"
        else:
            b = v.encode()
            out += b"t" + struct.pack(">I", len(b)) + b
    return out


def test_lsn_text_round_trips():
    assert lsn_int("0/0") == 0
    assert lsn_int("16/B374D848") == (0x16 << 32) | 0xB374D848
    for v in (0, 1, 0xFFFFFFFF, 1 << 32, (0x16 << 32) | 0xB374D848):
        assert lsn_int(lsn_str(v)) == v


def test_reader_walks_a_tuple_with_text_null_and_unchanged_values():
    r = Reader(b"I" + tuple_data("1", None, UNCHANGED, "é\u00e9 text", ""))
    assert r.tuple() == ["1", None, UNCHANGED, "é\u00e9 text", ""]
    assert r.p == len(r.d)


def test_reader_refuses_an_unknown_value_kind():
    with pytest.raises(RuntimeFailure, match="unexpected tuple value kind"):
        Reader(b"I" + struct.pack(">H", 1) + b"x").tuple()


def capture() -> WalCapture:
    d = WalCapture(JobConfig(path=Path("unit.ini"), job_name="unit", queue_name="q"))
    d.rels[7] = Relation(7, "public.t", ["id", "v"], ["integer", "text"], [0])
    return d


def msg(kind: bytes, body: bytes) -> bytes:
    return kind + body


def test_a_transaction_is_buffered_per_table_and_a_key_change_becomes_delete_and_the_new_row():
    d = capture()
    d.handle(msg(b"B", struct.pack(">qqI", 1000, 1_500_000, 42)))  # commits 1.5 s after 2000-01-01
    d.handle(msg(b"I", struct.pack(">I", 7) + b"N" + tuple_data("1", "a")))
    d.handle(msg(b"U", struct.pack(">I", 7) + b"N" + tuple_data("1", "b")))  # same key: an update
    d.handle(msg(b"U", struct.pack(">I", 7) + b"K" + tuple_data("1", None) + b"N" + tuple_data("2", "b")))
    d.handle(msg(b"D", struct.pack(">I", 7) + b"K" + tuple_data("2", None)))
    d.handle(msg(b"C", struct.pack(">bqqq", 0, 1000, 1100, 0)))
    at = "2000-01-01T00:00:01.500000+00:00"  # each event's ev_time: its transaction's commit time
    assert d.buf[7] == [
        ["I", ["1", "a"], at],
        ["U", ["1", "b"], at],
        ["D", ["1", None], at],
        ["U", ["2", "b"], at],
        ["D", ["2", None], at],
    ]
    assert d.buf_origin is None
    assert d.last_end == 1100 and d.txns == 1 and not d.in_txn


def test_a_two_way_peers_transaction_is_tagged_with_the_peer() -> None:
    d = capture()
    d.handle(msg(b"B", struct.pack(">qqI", 1000, 0, 42)))
    d.handle(msg(b"O", struct.pack(">q", 900) + b"pgcascade_paris\0"))  # applied from peer paris
    assert d.origin == "paris"
    d.handle(msg(b"B", struct.pack(">qqI", 2000, 0, 43)))
    assert d.origin is None, "the next transaction is this master's own again"
    d.handle(msg(b"O", struct.pack(">q", 900) + b"another_tool\0"))
    assert d.origin is None, "an origin pgcascade did not make is not a peer"


def test_a_transaction_captured_before_is_skipped():
    d = capture()
    d.stored = 2000  # the queue holds everything whose commit starts below this
    d.handle(msg(b"B", struct.pack(">qqI", 1500, 0, 43)))
    d.handle(msg(b"I", struct.pack(">I", 7) + b"N" + tuple_data("3", "c")))
    d.handle(msg(b"C", struct.pack(">bqqq", 0, 1500, 1600, 0)))
    assert not d.buf and d.skipped == 1 and d.txns == 0


def test_an_unchanged_toasted_value_without_the_old_row_is_an_error():
    d = capture()
    d.handle(msg(b"B", struct.pack(">qqI", 1000, 0, 44)))
    with pytest.raises(RuntimeFailure, match="REPLICA IDENTITY FULL"):
        d.handle(msg(b"U", struct.pack(">I", 7) + b"N" + tuple_data("1", UNCHANGED)))


def test_the_daemon_writes_images_of_known_types_and_leaves_the_rest_to_the_server():
    """capture/images.py: a row's JSON as row_to_json writes it (checked against the server in
    tests/scenario/test_walcapture.py); None where the server must make it."""
    from pgcascade.capture.images import renderer

    render = renderer(['a"%s', "b", "c", "d"], [23, 25, 1184, 26])
    assert render is not None
    assert render(["1", 'x"\n', "2026-11-29 17:45:13+05", "7"]) == (
        '{"a\\"%s":1,"b":"x\\"\\n","c":"2026-11-29T17:45:13+05:00","d":"7"}'
    )
    assert render([None, "", "infinity", None]) == '{"a\\"%s":null,"b":"","c":"infinity","d":null}'
    assert render(["1", UNCHANGED, None, None]) is None  # an unchanged TOASTed value
    assert render(["1", "x", "0044-03-15 12:00:00+00:53:28 BC", None]) is None  # BC, offset seconds
    assert renderer(["a", "j"], [23, 3802]) is None  # jsonb: JSON nulls are marked by the server
