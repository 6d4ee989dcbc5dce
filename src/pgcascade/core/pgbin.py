"""Where this host's PostgreSQL binaries are (psql for the copy stream, initdb for dev clusters)."""

from __future__ import annotations

import os
from pathlib import Path


def pg_bindir() -> Path:
    """The PostgreSQL server binaries: $PGCASCADE_PG_BIN, else Debian's PostgreSQL 15 location."""
    env = os.environ.get("PGCASCADE_PG_BIN")
    candidates = [Path(env)] if env else []
    candidates += [Path("/usr/lib/postgresql/15/bin")]
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for c in candidates:
        if (c / "initdb").exists():
            return c
    raise RuntimeError("PostgreSQL server binaries not found: run scripts/install.sh or set PGCASCADE_PG_BIN")
