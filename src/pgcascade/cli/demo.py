"""`pgcascade demo`: the README's main job, on throwaway local clusters (pgcascade.dev)."""

from __future__ import annotations

import click

from pgcascade.dev.demo import run_demo
from pgcascade.dev.demo_queue import run_queue_demo


@click.command()
@click.option("--seconds", default=30.0, show_default=True, help="How long the workload runs.")
@click.option("--keep", is_flag=True, help="Leave the clusters running and print how to reach them.")
@click.option(
    "--serve-port",
    type=click.IntRange(0, 65535),
    default=8432,
    show_default=True,
    help="Port of the set's live page while the demo runs (0: no page).",
)
@click.option("--queue", "queue_only", is_flag=True, help="The queue demo: writers, ticker and a consumer.")
def demo(seconds: float, keep: bool, serve_port: int, queue_only: bool) -> None:
    """Run the demo on throwaway local clusters: root, branch, leaf, pgbench, live status, a final check."""
    if queue_only:
        run_queue_demo(seconds=seconds, keep=keep)
    else:
        run_demo(seconds=seconds, keep=keep, serve_port=serve_port or None)


COMMANDS = [demo]
