"""Prometheus metrics of the daemons (prometheus-client), served on `metrics_port`.

Every daemon (ticker, worker, capture, sink) started with `metrics_port` in its ini serves
`/metrics` on `metrics_address` (127.0.0.1 by default) from a thread of its own; a copy process
serves none (its worker's port is taken).  Names follow Prometheus' conventions (`_total` for
counters, base units: seconds, bytes); labels are the set (queue), the node and the daemon's
job, so one Grafana dashboard serves every node.  The metrics are defined here once; the
daemons update them where the figures arise, at no cost beyond a counter increment per batch
(the lag is read from the provider once per watermark_period, and only when metrics are on).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from pgcascade.core.errors import ConfigError

log = logging.getLogger("pgcascade")

JOB = ["daemon", "job"]
NODE = ["set", "node"]

UP = Gauge("pgcascade_daemon_up", "1 while the daemon runs (its last round did not fail)", JOB)
STARTED = Gauge("pgcascade_daemon_start_time_seconds", "when the daemon started (unix time)", JOB)
ERRORS = Counter("pgcascade_errors_total", "failed rounds, by the kind of error", [*JOB, "kind"])

LAG_SECONDS = Gauge("pgcascade_lag_seconds", "age, on the provider, of the last tick applied here", NODE)
LAG_TICKS = Gauge("pgcascade_lag_ticks", "ticks the provider has that this node has not applied", NODE)
APPLIED_TICK = Gauge("pgcascade_applied_tick", "the last tick applied here", NODE)
BATCHES = Counter("pgcascade_batches_total", "batches applied", NODE)
EVENTS = Counter("pgcascade_events_total", "events applied (row changes, truncates, DDL)", NODE)
BATCH_SECONDS = Histogram(
    "pgcascade_batch_duration_seconds",
    "time to apply one batch, from fetch to finish",
    NODE,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
PACE_SECONDS = Gauge(
    "pgcascade_pace_seconds",
    "the wait before the batch after a small one, while the host's CPUs are busy",
    NODE,
)
TABLES = Gauge(
    "pgcascade_tables", "tables replicated here, by copy state (NULL, in-copy, ..., ok)", [*NODE, "phase"]
)

CAPTURED = Counter(
    "pgcascade_capture_events_total", "row events the capture daemon wrote into the queue", ["set"]
)
CAPTURE_LAG = Gauge(
    "pgcascade_capture_lag_seconds", "age of the last source commit captured, when it was captured", ["set"]
)
TICKS = Counter("pgcascade_ticks_total", "ticks the ticker made", ["database"])


def serve(port: int | None, address: str, daemon: str, job: str) -> bool:
    """Start /metrics for this daemon when a port is configured; whether it was started."""
    if port is None:
        return False
    try:
        start_http_server(port, addr=address)
    except OSError as e:
        raise ConfigError(
            f"metrics_port = {port}: cannot listen on {address}:{port} ({e.strerror})"
        ) from None
    log.info("metrics on http://%s:%d/metrics", address, port)
    UP.labels(daemon, job).set(1)
    STARTED.labels(daemon, job).set_to_current_time()
    return True
