#!/usr/bin/env bash
# Command 2 of the README: install what is missing, then lint, type-check, check the layering,
# check that docs/reference.md is current and the docs site builds without a broken link, and
# run the tests.
#   ./test.sh                 every tier (what CI runs)
#   ./test.sh unit|db|scenario [PYTEST ARGS]   one tier; unit needs neither PostgreSQL nor Spark
set -euo pipefail
cd "$(dirname "$0")"
paths=()
case "${1:-}" in
  unit | db | scenario)
    paths=("tests/$1")
    shift
    ;;
esac
if [ "${paths[*]-}" = "tests/unit" ]; then
  bash scripts/install.sh --python-only
else
  bash scripts/install.sh
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
.venv/bin/python scripts/reference.py --check
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
# two xdist workers, a module's tests on one of them (its module-scoped clusters and Spark are
# made once): the tests mostly wait on daemons, so two run in about 60% of the time of one;
# modules go to the workers longest first (tests/conftest.py orders them; xdist's own reorder,
# by number of tests, would leave single long Spark modules for the end);
# PGCASCADE_TEST_WORKERS=0 runs them in this process
exec .venv/bin/pytest -n "${PGCASCADE_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "${paths[@]}" "$@"
