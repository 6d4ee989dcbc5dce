"""Two-way verbs: add-peer, conflicts (docs/two-way.md)."""

from __future__ import annotations

import datetime
import json

import click

from pgcascade.cascade import peers
from pgcascade.cli.context import Context, Duration, echo_json, note_secrets, pass_ctx
from pgcascade.pgq import node as nodes
from pgcascade.replica import conflicts as log
from pgcascade.replica.conflicts import DEFAULT_POLICY, ConflictPolicy


@click.command("add-peer")
@click.argument("peer")
@click.option("--location", required=True, help="Connection string of the peer master.")
@click.option(
    "--conflict",
    "policy",
    default=DEFAULT_POLICY,
    show_default=True,
    help="last-update-wins, first-update-wins, origin-wins:NODE, keep-local, apply-remote, error,"
    " function:NAME.",
)
@pass_ctx
def add_peer(ctx: Context, peer: str, location: str, policy: str) -> None:
    """Replay master PEER's changes here (two-way); run on every master for every other one."""
    parsed = ConflictPolicy.parse(policy)
    with ctx.connect() as conn:
        created = peers.add_peer(conn, ctx.queue(), peer, location, parsed)
    click.echo(f"peer {peer}: {'added' if created else 'updated'} (conflicts: {parsed})")
    note_secrets({"--location": location})


@click.command("conflicts")
@click.option("--since", type=Duration(), help="Only those of the last DURATION (30s, 5min, 2h).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@pass_ctx
def conflicts(ctx: Context, since: float | None, as_json: bool) -> None:
    """The conflicts this master's apply of its peers found, and how each was resolved."""
    with ctx.this_node() as (conn, _node):
        queues = [p.queue_name for p in nodes.peers(conn, ctx.queue())]
        start = None
        if since is not None:
            now = conn.execute("select now()").fetchone()
            assert now is not None
            start = now[0] - datetime.timedelta(seconds=since)
        found = log.conflicts(conn, queues, start)
    if as_json:
        echo_json([c.__dict__ for c in found])
        return
    for c in found:
        click.echo(
            f"{c.logged:%Y-%m-%d %H:%M:%S} {c.conflict_type} {c.table_name} key {json.dumps(c.row_key)}:"
            f" local ({c.local_origin or '-'}) vs remote ({c.remote_origin}), {c.policy}: {c.winner} kept"
        )
    click.echo(f"{len(found)} conflicts")


COMMANDS = [add_peer, conflicts]
