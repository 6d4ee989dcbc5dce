#!/usr/bin/env bash
# Installs the peer systems that the benchmarks measure pgcascade against, from Debian's packages:
#   bench/queue_bench.py:        PgQ 3 (the PostgreSQL 15 extension) and its ticker daemon pgqd;
#   bench/replication_bench.py:  Londiste 3 as well (pgq_node and londiste extensions, the
#                                londiste script for the system Python 3, which has psycopg2);
#   bench/two_way_bench.py:      pglogical 2 (the PostgreSQL 15 extension, preloaded by the bench);
#   --callgrind of capture_cpu.py and fetch_cpu.py: valgrind.
# Native logical replication and pgbench come with PostgreSQL 15 itself. Root only; idempotent.
set -euo pipefail

PACKAGES=(postgresql-15-pgq3 pgqd postgresql-15-pgq-node postgresql-15-londiste-sql python3-londiste
  postgresql-15-pglogical valgrind)

if [ "$(id -u)" -ne 0 ]; then
  echo "install-peers: run as root (apt-get install ${PACKAGES[*]})" >&2
  exit 2
fi
installed() {
  local p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
  done
}
if installed; then
  echo "install-peers: ok (already installed)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# the server packages must not start a cluster of their own: the benchmark starts its own
mkdir -p /etc/postgresql-common/createcluster.d
echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/pgcascade.conf
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
for ext in pgq pgq_node londiste pglogical; do
  test -f "/usr/share/postgresql/15/extension/$ext.control"
done
test -x /usr/bin/londiste
echo "install-peers: ok"
