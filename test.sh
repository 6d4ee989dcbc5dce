#!/usr/bin/env bash
# Command 2 of the README: install what is missing, then lint and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/pytest "$@"
