"""A row's JSON image made from pgoutput's text values, as `row_to_json` writes it.

The capture daemon's events must be the capture triggers' (`row_to_json(r)::text`).  Made by
the server, each value is parsed from the stream's text into its column's type and written out
again as JSON: ~12 us of the writer's backend a row (a 4-column row, 8 rows a statement).  For
the types whose JSON is their text as pgoutput sends it (under the walsender's ISO DateStyle),
quoted and escaped or not, the daemon writes the image itself: numbers as they are (NaN and the
infinities quoted), strings escaped as `escape_json` does (`json.encoder.encode_basestring`
escapes the same characters the same way), booleans as true/false, dates and times in ISO 8601
with a `T` (`USE_XSD_DATES`: the time zone's minutes always written).  A table with a column of
another type (a domain, an array, json, an interval, ...) keeps the server's way, and so do a
statement's rows with a value this module does not write (a time zone with seconds, say).
"""

from __future__ import annotations

from collections.abc import Callable
from json.encoder import encode_basestring

from pgcascade.capture.pgoutput import Value

Render = Callable[[list[Value]], "str | None"]

NOT_NUMBERS = frozenset(("NaN", "Infinity", "-Infinity"))


def _number(v: str) -> str:
    return f'"{v}"' if v in NOT_NUMBERS else v


def _integer(v: str) -> str:
    return v


def _boolean(v: str) -> str:
    return "true" if v == "t" else "false"


def _plain(v: str) -> str:  # text no JSON escape can touch: dates, uuids
    return f'"{v}"'


def _timestamp(v: str) -> str:
    return f'"{v.replace(" ", "T", 1)}"'


def _timestamptz(v: str) -> str | None:
    t = v.find(" ")
    if t < 0:
        return f'"{v}"'  # infinity, -infinity
    if v.endswith(" BC"):
        return None
    sign = max(v.rfind("+", t), v.rfind("-", t))
    zone = v[sign + 1 :]
    if len(zone) == 2:  # +HH: XSD writes +HH:00
        return f'"{v[:t]}T{v[t + 1 :]}:00"'
    if len(zone) == 5:  # +HH:MM
        return f'"{v[:t]}T{v[t + 1 :]}"'
    return None  # seconds in the offset: the server's way


# type oid -> how its text becomes JSON (pg_type.dat's oids of the built-in types)
Convert = Callable[[str], str | None]
CONVERTERS: dict[int, Convert] = {
    16: _boolean,  # bool
    19: encode_basestring,  # name
    20: _integer,  # int8
    21: _integer,  # int2
    23: _integer,  # int4
    25: encode_basestring,  # text
    26: _plain,  # oid (a string in row_to_json)
    700: _number,  # float4
    701: _number,  # float8
    1042: encode_basestring,  # bpchar
    1043: encode_basestring,  # varchar
    1082: _plain,  # date
    1114: _timestamp,  # timestamp
    1184: _timestamptz,  # timestamptz
    1700: _number,  # numeric
    2950: _plain,  # uuid
}


def renderer(names: list[str], types: list[int]) -> Render | None:
    """The function that writes a row of these columns as its JSON image (None where it cannot
    write the row), or None when a column's type is not one it knows."""
    found = [CONVERTERS.get(t) for t in types]
    convs = [c for c in found if c is not None]
    if len(convs) < len(found):
        return None
    template = "{" + ",".join(encode_basestring(n).replace("%", "%%") + ":%s" for n in names) + "}"

    def render(vals: list[Value], convs: list[Convert] = convs, template: str = template) -> str | None:
        # a value is text, None (SQL null) or pgoutput's unchanged TOAST marker (not written
        # here); the columns as locals, and no zip(strict=): 20 % of a row's time
        out = [
            conv(v) if v.__class__ is str else ("null" if v is None else None)
            for conv, v in zip(convs, vals)  # noqa: B905 (as many: the relation's columns)
        ]
        return None if None in out else template % tuple(out)

    return render
