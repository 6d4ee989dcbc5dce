"""`auto-ddl on|off`: DDL run the ordinary way on a root (or a two-way master) reaches its
subscribers and peers by itself (capture/ddl.py; docs/ddl.md)."""

from __future__ import annotations

import click

from pgcascade.capture import ddl
from pgcascade.cli.context import Context, pass_ctx, say
from pgcascade.core.errors import UserError


@click.command("auto-ddl")
@click.argument("switch", type=click.Choice(["on", "off"]))
@click.option(
    "--add-new-tables",
    is_flag=True,
    help="Tables created in a schema of the set's tables join the set (and subscribers that hold --all).",
)
@pass_ctx
def auto_ddl(ctx: Context, switch: str, add_new_tables: bool) -> None:
    """Capture DDL run the ordinary way on this root or master, replayed in order by every node."""
    queue = ctx.queue()
    with ctx.this_node() as (conn, node):
        if not node.role.is_root or node.is_peer:
            raise UserError(
                f"auto-ddl is for a root or a two-way master: this node is a {node.node_type} of {queue},"
                " and runs the DDL its provider sends"
            )
        if switch == "off":
            if add_new_tables:
                raise UserError("--add-new-tables goes with auto-ddl on")
            note = ddl.disable(conn, queue)
            if note:
                say(note)
            click.echo(f"auto-ddl of {queue}: off")
            return
        ddl.enable(conn, queue, add_new_tables)
        setting = ddl.setting(conn, queue)
        assert setting is not None
        click.echo(f"auto-ddl of {queue}: {setting.describe()}")


COMMANDS = [auto_ddl]
