"""The cascade's verbs: members, change-provider, takeover, resurrect, drop-node, pause,
resume, wait-root, wait-provider.  The work is in pgcascade.cascade."""

from __future__ import annotations

from pathlib import Path

import click

from pgcascade.cascade import admin, provider, survey, waits
from pgcascade.cascade import takeover as takeovers
from pgcascade.cli.context import Context, echo_json, pass_ctx, say
from pgcascade.core.errors import RuntimeFailure, UserError, redact
from pgcascade.monitor import report
from pgcascade.pgq import node as nodes


@click.command()
@click.option("--json", "as_json", is_flag=True, help="As JSON (docs/monitoring.md).")
@pass_ctx
def members(ctx: Context, as_json: bool) -> None:
    """List the set's nodes: name, type, provider, location (passwords hidden)."""
    with ctx.this_node() as (conn, _):
        if as_json:
            echo_json(report.members_report(conn, ctx.queue()))
            return
        for m in survey.survey(conn, ctx.queue()):
            kind = m.node.node_type if m.node else ("dead" if m.dead else "unreachable")
            prov = (m.node.provider_node or "-") if m.node else "?"
            click.echo(f"{m.name}\t{kind}\t{prov}\t{redact(m.location)}")


@click.command("change-provider")
@click.option("--provider", "new_provider", required=True, help="Name of the node to feed from.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for a provider behind us.")
@click.option("--no-wait", is_flag=True, help="Refuse instead of waiting for a provider that is behind.")
@pass_ctx
def change_provider(ctx: Context, new_provider: str, timeout: float, no_wait: bool) -> None:
    """Feed this node from another node of the set, with no gap and no duplicate."""
    with ctx.connect() as conn:
        click.echo(provider.change_provider(conn, ctx.queue(), new_provider, say, timeout, no_wait))


@click.command()
@click.argument("old_node")
@click.option("--dead-root", is_flag=True, help="The root is lost: become the root (failover).")
@click.option("--dead-branch", is_flag=True, help="The branch is lost: take over its subscribers.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for each step.")
@click.option(
    "--force", is_flag=True, help="Become the root even if tables lack defaults or sequences are behind."
)
@pass_ctx
def takeover(
    ctx: Context, old_node: str, dead_root: bool, dead_branch: bool, timeout: float, force: bool
) -> None:
    """Take OLD_NODE's place: a live root becomes our branch (switchover); --dead-root and
    --dead-branch take over from a lost node."""
    if dead_root and dead_branch:
        raise UserError("--dead-root and --dead-branch exclude each other")
    queue = ctx.queue()
    with ctx.this_node() as (conn, me):
        if dead_root:
            click.echo(takeovers.failover(conn, queue, old_node, say, timeout, force))
        elif dead_branch:
            click.echo(provider.take_subscribers(conn, queue, old_node, True, say, timeout))
        elif me.provider_node == old_node and me.role.copies_events and old_is_root(conn, queue, old_node):
            click.echo(takeovers.switchover(conn, queue, old_node, say, timeout, force))
        else:
            click.echo(provider.take_subscribers(conn, queue, old_node, False, say, timeout))


def old_is_root(conn, queue: str, old_node: str) -> bool:
    """Whether our provider is the live root (a switchover); one that does not answer is an error."""
    with survey.reach(survey.member_location(conn, queue, old_node)) as oc:
        old = nodes.get_node(oc, queue) if oc is not None else None
    if old is None:
        raise RuntimeFailure(f"{old_node} does not answer: use --dead-root or --dead-branch")
    return old.role.is_root


@click.command()
@click.option(
    "--lost-events",
    type=click.Path(dir_okay=False),
    help="File for the events that never reached the set (default: JOB_NAME.lost-events.jsonl beside the config).",
)
@pass_ctx
def resurrect(ctx: Context, lost_events: str | None) -> None:
    """An old root that was taken over comes back: save what it alone had, make it a branch."""
    path = Path(lost_events or ctx.cfg.path.parent / f"{ctx.cfg.job_name}.lost-events.jsonl")
    with ctx.connect() as conn:
        click.echo(admin.resurrect(conn, ctx.queue(), ctx.db(), path, say))


@click.command("drop-node")
@click.argument("node_name")
@pass_ctx
def drop_node(ctx: Context, node_name: str) -> None:
    """Remove a node from the set (its registrations go, rotation is released)."""
    with ctx.this_node() as (conn, _):
        click.echo(admin.drop_node(conn, ctx.queue(), node_name))


@click.command()
@click.argument("node_name", required=False)
@pass_ctx
def pause(ctx: Context, node_name: str | None) -> None:
    """Pause a node's worker (this node by default)."""
    with ctx.this_node() as (conn, me):
        click.echo(admin.set_paused(conn, ctx.queue(), node_name or me.node_name, True))


@click.command()
@click.argument("node_name", required=False)
@pass_ctx
def resume(ctx: Context, node_name: str | None) -> None:
    """Resume a paused node's worker (this node by default)."""
    with ctx.this_node() as (conn, me):
        click.echo(admin.set_paused(conn, ctx.queue(), node_name or me.node_name, False))


@click.command("wait-root")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait at most.")
@pass_ctx
def wait_root(ctx: Context, timeout: float) -> None:
    """Wait until this node applied everything committed on the root before now."""
    with ctx.connect() as conn:
        tick = waits.wait_root(conn, ctx.queue(), say, timeout)
    click.echo(f"applied the root's tick {tick}")


@click.command("wait-provider")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait at most.")
@pass_ctx
def wait_provider(ctx: Context, timeout: float) -> None:
    """Wait until this node applied every tick its provider has now."""
    with ctx.connect() as conn:
        tick = waits.wait_provider(conn, ctx.queue(), say, timeout)
    click.echo(f"applied the provider's tick {tick}")


COMMANDS = [members, change_provider, takeover, resurrect, drop_node, pause, resume, wait_root, wait_provider]
