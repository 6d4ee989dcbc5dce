"""The daemon base every long-running pgcascade process uses (ticker, worker, copy).

A subclass implements `work() -> bool` (True: there may be more to do at once; False: sleep
`loop_delay` or until `wake_up()`).  The base owns what every daemon needs and what Skytools
daemons do: a pidfile that refuses a second copy, `-d` (detach), signals (SIGINT: stop after
the current unit of work, `-s`; SIGTERM: stop now, `-k`; SIGHUP: reload, `-r`), logging to the
logfile, and a back-off after errors so a database restart does not become a tight loop.  A
daemon that a node runs once (`lock_role`: the worker, the capture daemon; the ticker takes one
per database it serves) holds its lock in the node's database and checks it before every round
(core/daemonlock.py): a second copy is refused whatever its ini and pidfile, and one that lost
its lock to another stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

import psycopg

from pgcascade.core import pgconn, privileges
from pgcascade.core.config import JobConfig, load_config
from pgcascade.core.daemonlock import AlreadyRunning, DaemonLock, DaemonRole, pid_alive
from pgcascade.core.errors import ConfigError, RuntimeFailure, UserError, redact

log = logging.getLogger("pgcascade")

LOG_FORMAT = "%(asctime)s %(process)d %(levelname)s %(message)s"


def _metrics() -> ModuleType:
    """core.metrics, imported by a daemon when it runs: prometheus-client is a tenth of a second
    of start-up that the CLI's other verbs (which import this module) do not need."""
    from pgcascade.core import metrics

    return metrics


class RedactingFormatter(logging.Formatter):
    # the time's text down to the second, for the records of that second: a worker logs a line
    # per batch, hundreds a second, and strftime was a seventh of that line's cost
    _second: tuple[int, str] = (-1, "")

    def format(self, record: logging.LogRecord) -> str:
        # formatted once for both handlers (stderr and the log file): a worker logs a line per batch
        text = getattr(record, "pgcascade_text", None)
        if text is None:
            text = redact(super().format(record))
            record.pgcascade_text = text
        return text

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if self._second[0] != second:
            self._second = (second, time.strftime(self.default_time_format, self.converter(second)))
        return f"{self._second[1]},{int(record.msecs):03d}"


def setup_logging(
    logfile: Path | None, verbose: bool = False, quiet: bool = False, to_stderr: bool = True
) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = RedactingFormatter(LOG_FORMAT)
    if to_stderr and not quiet:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        root.addHandler(h)
    if logfile:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(logfile)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("psycopg").setLevel(logging.WARNING)
    # what LOG_FORMAT does not show is not gathered for each record (the logging HOWTO's
    # "Optimization"): a worker logs a line per batch, and walking the stack for the caller's
    # file and line was a tenth of that line's cost
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False


def use_connection_settings(cfg: JobConfig) -> None:
    """The config's TCP settings for every connection this process opens (core/pgconn.py)."""
    c = cfg.connection
    pgconn.configure(
        pgconn.TcpSettings(
            c.tcp_keepalives_idle, c.tcp_keepalives_interval, c.tcp_keepalives_count, c.tcp_user_timeout
        )
    )


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def signal_daemon(cfg: JobConfig, sig: signal.Signals, wait: float = 30.0) -> int:
    """Send `sig` to the job's running daemon (from its pidfile); for stop signals wait until it exits."""
    if cfg.pidfile is None:
        raise UserError(f"{cfg.path}: pidfile is not set, so the running daemon cannot be found")
    pid = read_pid(cfg.pidfile)
    if pid is None or not pid_alive(pid):
        raise RuntimeFailure(f"{cfg.job_name} is not running (no live process in {cfg.pidfile})")
    os.kill(pid, sig)
    if sig in (signal.SIGINT, signal.SIGTERM):
        deadline = time.monotonic() + wait
        while pid_alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{cfg.job_name} (pid {pid}) did not stop within {wait:.0f}s")
            time.sleep(0.05)
    return pid


def daemonize() -> None:
    """Detach from the terminal: double fork, new session, stdio to /dev/null."""
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


class Daemon:
    """Base of the daemons: subclass, implement `work()`, call `start()`."""

    name = "daemon"
    default_loop_delay = 1.0  # seconds between idle rounds when the config sets no loop_delay
    lock_role: DaemonRole | None = None  # one per node and queue: held in the database (claim)

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.stop_requested = False  # SIGINT: finish the current unit of work, then exit
        self.reload_requested = False
        self.loop_delay = cfg.loop_delay or self.default_loop_delay
        self.error_backoff = 0.0
        self.metrics = False  # /metrics is served (metrics_port set)
        self.lock: DaemonLock | None = None
        self.exit_code = 0

    # --- to implement ---
    def work(self) -> bool:
        raise NotImplementedError

    def reload(self) -> None:
        """Re-read what may change at run time (called on SIGHUP)."""

    def shutdown(self) -> None:
        """Release resources before exit."""

    def drop_connections(self) -> None:
        """Close the daemon's connections: after a connection failure the next round opens them again."""

    def report_error(self, e: Exception) -> None:
        """Make a failed round visible (the worker stores it for `status`)."""

    def recovered(self) -> None:
        """A round worked after failed ones (a copy process clears its table's error)."""

    def on_kill(self) -> None:
        """Called on SIGTERM before exiting (the worker stops its copy processes first)."""

    def sleep(self, seconds: float) -> None:
        """Wait between rounds; a subclass may wait on LISTEN instead."""
        time.sleep(seconds)

    def backoff_sleep(self, seconds: float) -> None:
        """Wait after an error: real time (not woken by ticks), cut short by a stop request."""
        deadline = time.monotonic() + seconds
        while not self.stop_requested and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))

    # --- the lock in the database (core/daemonlock.py) ---
    def claim(self) -> None:
        """Take the daemon's lock before the first round: AlreadyRunning refuses the start.  An
        unreachable database is no refusal: the lock is taken before the first round there."""
        if self.lock_role is None or not self.cfg.db:
            return
        self.lock = DaemonLock(
            self.cfg.db, self.lock_role, self.cfg.queue_name or "", self.cfg.job_name, str(self.cfg.path)
        )
        try:
            self.lock.acquire()
        except psycopg.OperationalError as e:
            log.warning("cannot take the %s lock yet (%s): taken before the first round", self.name, e)

    def keep_lock(self) -> None:
        """Before a round: still the one daemon (a lost lock taken again, or AlreadyRunning)."""
        if self.lock is not None:
            self.lock.keep()

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()

    # --- lifecycle ---
    def start(self, detach: bool = False) -> int:
        if detach:
            if not self.cfg.logfile or not self.cfg.pidfile:
                raise UserError(f"{self.cfg.path}: -d needs logfile and pidfile in the config")
            self._check_not_running()  # before detaching, while the user still sees the error
            self.claim()  # the lock's connection goes with the detached process
            daemonize()
            setup_logging(self.cfg.logfile, to_stderr=False)
        self._install_signals()  # before the pidfile: `-s` finds the pid only once they are in place
        self._take_pidfile()
        try:
            if not detach:
                self.claim()
            self.metrics = _metrics().serve(
                self.cfg.metrics_port, self.cfg.metrics_address, self.name, self.cfg.job_name
            )
            log.info("%s %s starting (pid %d)", self.name, self.cfg.job_name, os.getpid())
            self.run_loop()
            log.info("%s %s stopped", self.name, self.cfg.job_name)
            return self.exit_code
        finally:
            self.shutdown()
            self.release_lock()
            self._release_pidfile()

    def run_loop(self) -> None:
        while not self.stop_requested:
            if self.reload_requested:
                self.reload_requested = False
                log.info("reloading config %s", self.cfg.path)
                try:
                    self.cfg = load_config(self.cfg.path)
                    use_connection_settings(self.cfg)
                except ConfigError as e:
                    log.error("%s; keeping the config loaded before", e)
                self.reload()
            try:
                self.keep_lock()
                busy = self.work()
                if self.error_backoff:
                    self.recovered()
                    if self.metrics:
                        _metrics().UP.labels(self.name, self.cfg.job_name).set(1)
                self.error_backoff = 0.0
            except (KeyboardInterrupt, SystemExit):
                raise
            except AlreadyRunning as e:
                log.error("%s: stopping", e)
                self.exit_code = 1
                break
            except Exception as e:
                if isinstance(e, psycopg.OperationalError):
                    self.drop_connections()  # one reconnect rule for every daemon
                if self.metrics:
                    _metrics().ERRORS.labels(self.name, self.cfg.job_name, type(e).__name__).inc()
                    _metrics().UP.labels(self.name, self.cfg.job_name).set(0)
                self.error_backoff = min(max(self.error_backoff * 2, 1.0), 30.0)
                detail = (  # a missing privilege: with the grant to run
                    privileges.explain(e, self.cfg.db) if privileges.is_refusal(e) else redact(str(e)).strip()
                )
                log.error("%s: %s (retrying in %.0fs)", type(e).__name__, detail, self.error_backoff)
                log.debug("traceback", exc_info=True)
                self.report_error(e)
                self.backoff_sleep(self.error_backoff)
                continue
            if not busy and not self.stop_requested:
                self.sleep(self.loop_delay)

    def _install_signals(self) -> None:
        def graceful(_sig, _frm):
            log.info("stop requested: finishing the current work")
            self.stop_requested = True

        def hard(_sig, _frm):
            log.info("kill requested: exiting now")
            self.on_kill()
            raise SystemExit(1)

        def hup(_sig, _frm):
            self.reload_requested = True

        signal.signal(signal.SIGINT, graceful)
        signal.signal(signal.SIGTERM, hard)
        signal.signal(signal.SIGHUP, hup)

    def _check_not_running(self) -> None:
        pf = self.cfg.pidfile
        pid = read_pid(pf) if pf is not None else None
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            raise RuntimeFailure(f"{self.cfg.job_name} is already running (pid {pid}, {pf})")

    def _take_pidfile(self) -> None:
        pf = self.cfg.pidfile
        if pf is None:
            return
        self._check_not_running()
        pf.parent.mkdir(parents=True, exist_ok=True)
        tmp = pf.with_suffix(pf.suffix + ".tmp")
        tmp.write_text(f"{os.getpid()}\n")
        tmp.replace(pf)

    def _release_pidfile(self) -> None:
        pf = self.cfg.pidfile
        if pf is not None and read_pid(pf) == os.getpid():
            with contextlib.suppress(OSError):
                pf.unlink()
