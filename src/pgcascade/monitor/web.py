"""`pgcascade CONF serve`: the live page of a set, on Starlette served by uvicorn.

    /               the page: the set's tree as a graph, each node's lag and state, its tables
                    with their lag and copy progress (bar and ETA), the last errors; it polls
                    /api/topology every serve_refresh seconds
    /api/topology   the set as JSON (monitor/topology.py; schema in docs/monitoring.md)
    /metrics        Prometheus metrics of every node (monitor/exporter.py SetCollector)
    /healthz        200 once the set has been read, 503 before or when the last reading failed

One thread reads the set every serve_refresh seconds, whatever the number of viewers: a page
open in ten browsers costs the databases what one costs.  Read-only; passwords never leave it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pgcascade.core import pgconn
from pgcascade.core.errors import ConfigError, db_error_line
from pgcascade.monitor.exporter import SetCollector
from pgcascade.monitor.topology import topology

log = logging.getLogger("pgcascade.serve")

PAGE_DIR = Path(__file__).parent / "page"


class SetReader:
    """Reads the set every `refresh` seconds in a thread; the last reading is what every
    request gets.  A failed reading keeps the previous one and says why."""

    def __init__(self, dsn: str, queue: str, refresh: float):
        self.dsn, self.queue, self.refresh = dsn, queue, refresh
        self.lock = threading.Lock()
        self.last: dict[str, Any] | None = None
        self.error: str | None = None
        self.stopping = threading.Event()

    def read_once(self) -> None:
        try:
            with pgconn.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                topo = topology(conn, self.queue)
            with self.lock:
                self.last, self.error = topo, None
        except psycopg.Error as e:
            with self.lock:
                self.error = db_error_line(e)
            log.warning("serve: cannot read the set: %s", self.error)

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            self.read_once()
            self.stopping.wait(max(0.0, self.refresh - (time.monotonic() - started)))

    def current(self) -> dict[str, Any] | None:
        with self.lock:
            if self.last is None:
                return None
            return {**self.last, "refresh_seconds": self.refresh, "reading_error": self.error}


def build_app(reader: SetReader) -> Starlette:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SetCollector(reader.current))

    async def page(_: Request) -> Response:
        return FileResponse(PAGE_DIR / "index.html", headers={"Cache-Control": "no-store"})

    async def api_topology(_: Request) -> Response:
        topo = reader.current()
        if topo is None:
            return JSONResponse({"error": reader.error or "reading the set"}, status_code=503)
        return JSONResponse(topo, headers={"Cache-Control": "no-store"})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        ok = reader.current() is not None and reader.error is None
        return JSONResponse({"ok": ok, "error": reader.error}, status_code=200 if ok else 503)

    return Starlette(
        routes=[
            Route("/", page),
            Route("/api/topology", api_topology),
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Mount("/static", StaticFiles(directory=PAGE_DIR), name="static"),
        ]
    )


def serve(dsn: str, queue: str, address: str, port: int, refresh: float) -> None:
    """Run until SIGINT/SIGTERM (uvicorn handles both and closes the connections)."""
    reader = SetReader(dsn, queue, refresh)
    reader.read_once()  # the page has data from its first request
    threading.Thread(target=reader.run, name="set-reader", daemon=True).start()
    config = uvicorn.Config(build_app(reader), host=address, port=port, log_level="warning", access_log=False)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:  # bound here, not by uvicorn: a port in use is one line of ours, not its log and exit
        sock = socket.create_server((address, port), family=family)
    except OSError as e:
        raise ConfigError(f"serve: cannot listen on {address}:{port} ({e.strerror})") from None
    log.info("serving set %s on http://%s:%d/", queue, address, port)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on: a normal stop
        log.info("serve stopped")
    finally:
        reader.stopping.set()
