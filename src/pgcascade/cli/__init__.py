"""The `pgcascade` command."""

from pgcascade.cli.main import main

__all__ = ["main"]
