"""Two-way conflicts: the policies, and the log (`pgcascade.conflict`) this module alone reads.

The conflicts themselves are found and resolved per row, set-based, by the peer apply's
statement (replica/peer_apply.py); which side wins is decided in one place, `winner_sql`.
"""

from __future__ import annotations

import datetime
import enum
import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pgcascade.core.errors import UserError


class PolicyKind(enum.StrEnum):
    LAST_UPDATE_WINS = "last-update-wins"
    FIRST_UPDATE_WINS = "first-update-wins"
    ORIGIN_WINS = "origin-wins"
    KEEP_LOCAL = "keep-local"
    APPLY_REMOTE = "apply-remote"
    ERROR = "error"
    FUNCTION = "function"


DEFAULT_POLICY = "last-update-wins"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*(\.[A-Za-z_][A-Za-z0-9_$]*)?")


@dataclass(frozen=True)
class ConflictPolicy:
    kind: PolicyKind
    arg: str | None = None  # origin-wins: the node; function: the function's name

    @classmethod
    def parse(cls, text: str) -> ConflictPolicy:
        kind_text, _, arg = text.strip().partition(":")
        try:
            kind = PolicyKind(kind_text)
        except ValueError:
            raise UserError(
                f"unknown conflict policy {text!r}: use one of "
                + ", ".join(
                    k.value + (":NAME" if k in (PolicyKind.ORIGIN_WINS, PolicyKind.FUNCTION) else "")
                    for k in PolicyKind
                )
            ) from None
        needs_arg = kind in (PolicyKind.ORIGIN_WINS, PolicyKind.FUNCTION)
        if needs_arg and not arg:
            raise UserError(f"conflict policy {kind.value} needs a name: {kind.value}:NAME")
        if not needs_arg and arg:
            raise UserError(f"conflict policy {kind.value} takes no argument")
        if kind is PolicyKind.FUNCTION and not NAME.fullmatch(arg):
            raise UserError(f"conflict policy function:{arg}: give a function name, schema-qualified or not")
        return cls(kind, arg or None)

    def check_function(self, conn: psycopg.Connection) -> None:
        """A function policy names a function this database has, with the documented signature."""
        if self.kind is not PolicyKind.FUNCTION:
            return
        ok = conn.execute(
            "select to_regprocedure(%s || '(text, text, jsonb, jsonb, text, text, timestamptz, timestamptz)')"
            " is not null",
            (self.arg,),
        ).fetchone()
        if not ok or not ok[0]:
            raise UserError(
                f"conflict policy function:{self.arg}: no function {self.arg}(text, text, jsonb, jsonb, text,"
                " text, timestamptz, timestamptz) returning 'local' or 'remote' in this database"
            )

    def __str__(self) -> str:
        return self.kind.value + (f":{self.arg}" if self.arg else "")


# the later commit time wins; the greater node name on a tie (first-update-wins: the reverse)
_BY_TIME = (
    "(case when coalesce(local_time, '-infinity') {cmp} remote_time"
    " or (coalesce(local_time, '-infinity') = remote_time and local_origin {cmp} {peer})"
    " then 'remote' else 'local' end)"
)


def winner_sql(policy: ConflictPolicy, peer: sql.Composable, table: sql.Composable) -> sql.Composable:
    """The SQL expression of the winner of a conflict ('local', 'remote', or anything else to stop
    the batch) over the columns the peer apply decides on: conflict, local_t (the local row),
    local_origin, local_time, ev_data (the remote row, JSON), remote_time."""
    lww = sql.SQL(_BY_TIME).format(cmp=sql.SQL("<"), peer=peer)
    match policy.kind:
        case PolicyKind.LAST_UPDATE_WINS:
            return lww
        case PolicyKind.FIRST_UPDATE_WINS:
            return sql.SQL(_BY_TIME).format(cmp=sql.SQL(">"), peer=peer)
        case PolicyKind.ORIGIN_WINS:
            node = sql.Literal(policy.arg)
            return sql.SQL(
                "(case when {peer} = {node} then 'remote' when local_origin = {node} then 'local' else {lww} end)"
            ).format(peer=peer, node=node, lww=lww)
        case PolicyKind.FUNCTION:
            assert policy.arg is not None and NAME.fullmatch(policy.arg)  # a name, checked by parse
            return sql.SQL(
                "{fn}(conflict, {table}::text, to_jsonb(local_t), ev_data::jsonb, local_origin, {peer}::text,"
                " local_time, remote_time)"
            ).format(fn=sql.SQL(policy.arg), table=table, peer=peer)
        case PolicyKind.KEEP_LOCAL:
            return sql.SQL("'local'")
        case PolicyKind.APPLY_REMOTE:
            return sql.SQL("'remote'")
        case PolicyKind.ERROR:
            return sql.SQL("'error'")


@dataclass(frozen=True)
class Conflict:
    conflict_id: int
    logged: datetime.datetime
    table_name: str
    conflict_type: str
    row_key: Any
    local_origin: str | None
    remote_origin: str
    policy: str
    winner: str
    local_row: Any
    remote_row: Any


def conflicts(
    conn: psycopg.Connection, peer_queues: list[str], since: datetime.datetime | None
) -> list[Conflict]:
    with conn.cursor() as cur:
        rows = cur.execute(
            "select conflict_id, logged, table_name, conflict_type, row_key, local_origin, remote_origin,"
            " policy, winner, local_row, remote_row from pgcascade.conflict"
            " where queue_name = any(%s) and (%s::timestamptz is null or logged >= %s) order by conflict_id",
            (peer_queues, since, since),
        ).fetchall()
    return [Conflict(*r) for r in rows]


def conflict_count(conn: psycopg.Connection, peer_queue: str) -> int:
    row = conn.execute(
        "select count(*) from pgcascade.conflict where queue_name = %s", (peer_queue,)
    ).fetchone()
    return int(row[0]) if row else 0
