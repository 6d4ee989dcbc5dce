#!/usr/bin/env bash
# Installs the peer systems that bench/queue_bench.py measures pgcascade against:
# PgQ 3 (the PostgreSQL 15 extension) and its ticker daemon pgqd, from Debian's packages.
# Root only; idempotent.
set -euo pipefail

PACKAGES=(postgresql-15-pgq3 pgqd)

if [ "$(id -u)" -ne 0 ]; then
  echo "install-peers: run as root (apt-get install ${PACKAGES[*]})" >&2
  exit 2
fi
if [ -f /usr/share/postgresql/15/extension/pgq.control ] && dpkg-query -W -f='${Status}' pgqd 2>/dev/null | grep -q "install ok installed"; then
  echo "install-peers: ok (already installed)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# the server packages must not start a cluster of their own: the benchmark starts its own
mkdir -p /etc/postgresql-common/createcluster.d
echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/pgcascade.conf
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
test -f /usr/share/postgresql/15/extension/pgq.control
echo "install-peers: ok"
