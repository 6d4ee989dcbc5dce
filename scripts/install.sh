#!/usr/bin/env bash
# Installs everything pgcascade needs on a fresh Debian 12 machine, idempotently:
#   - Debian packages (PostgreSQL 15 server and client, Java 17, the PostgreSQL JDBC driver,
#     Chromium for the page tests),
#     when run as root; otherwise names the missing ones and stops;
#   - a virtualenv in .venv with pgcascade and its Python dependencies.
# Re-running it is cheap: it only installs what is missing.
# --python-only: the virtualenv alone (the unit tests need no PostgreSQL, Java or Spark jar).
set -euo pipefail
cd "$(dirname "$0")/.."
python_only=false
[ "${1:-}" = "--python-only" ] && python_only=true

# chromium: the live page's browser tests (Playwright drives Debian's build; it downloads none)
# iproute2: the Spark cluster tests' second host (a network namespace and a veth pair)
# postgresql-15-pgq3 ... python3-londiste: the real PgQ and Londiste 3 that the drop-in tests migrate from
DEB_PACKAGES=(postgresql-15 postgresql-client-15 openjdk-17-jre-headless libpostgresql-jdbc-java chromium python3-venv iproute2
  postgresql-15-pgq3 pgqd postgresql-15-pgq-node postgresql-15-londiste-sql python3-londiste python3-pgq)

missing=()
$python_only && DEB_PACKAGES=(python3-venv)
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "install: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # the server package must not start a cluster of its own: the tests and the demo start theirs
    mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/pgcascade.conf
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "install: missing Debian packages: ${missing[*]} (run as root, or: sudo apt-get install ${missing[*]})" >&2
    exit 2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.pgcascade-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
# the package's bytecode, written here once: the install is editable, and where the environment
# sets PYTHONDONTWRITEBYTECODE (this machine's does) every pgcascade process - each command, each
# daemon - would otherwise compile its modules again (~0.12 s of CPU a start). A source newer
# than its .pyc is still read as source.
.venv/bin/python -m compileall -q -j 0 src >/dev/null
echo "install: ok (.venv/bin/pgcascade)"
