#!/usr/bin/env bash
# Command 1 of the README: install everything, then run the demo on throwaway clusters.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
exec .venv/bin/pgcascade demo "$@"
