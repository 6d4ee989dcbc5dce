"""A Spark standalone cluster of two "hosts" on one machine, for the tests and the benchmarks.

The master runs here, from pip's pyspark (`spark-class ...deploy.master.Master`); each worker
runs in a network namespace of its own, joined to this host by a veth pair, so it has its own
address and reaches the driver, the master and PostgreSQL only over that link, as a worker on
another machine would.  Its Python is a venv at another path that sees the third-party
libraries of this one but not pgcascade: what it runs of pgcascade is what the driver ships.

Needs root (ip netns, ip link) and Debian's iproute2.  Everything made is removed by `close()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pgcascade.dev.localcluster import free_port, wait_until
from pgcascade.pipeline.connect import spark_home


def can_make_hosts() -> str | None:
    """None when this process can make network namespaces; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "iproute2's ip command is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class NetHost:
    """A network namespace with one veth link to this host: subnet 10.231.N.0/24, this host .1."""

    name: str
    subnet: int
    made: bool = False

    @classmethod
    def free(cls, name: str) -> NetHost:
        """A host on a subnet no link of this machine uses yet (tests of other sessions may run)."""
        used = {int(p.name[4:]) for p in Path("/sys/class/net").glob("pgch*") if p.name[4:].isdigit()}
        return cls(name, random.choice([x for x in range(1, 250) if x not in used]))

    @property
    def address(self) -> str:
        return f"10.231.{self.subnet}.2"

    @property
    def gateway(self) -> str:
        """This host's address on the link: what the namespace reaches us at."""
        return f"10.231.{self.subnet}.1"

    @property
    def _veth(self) -> tuple[str, str]:
        return f"pgch{self.subnet}", f"pgcn{self.subnet}"

    def create(self) -> NetHost:
        outer, inner = self._veth
        _ip("netns", "add", self.name)
        self.made = True
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.name)
        _ip("addr", "add", f"{self.gateway}/24", "dev", outer)
        _ip("link", "set", outer, "up")
        for args in (
            ("addr", "add", f"{self.address}/24", "dev", inner),
            ("link", "set", inner, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", self.name, "ip", *args)
        return self

    def run(self, args: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *args], **kwargs)

    def destroy(self) -> None:
        if self.made:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            subprocess.run(["ip", "link", "del", self._veth[0]], capture_output=True)
            self.made = False


def without_pythonpath() -> dict[str, str]:
    """This environment minus PYTHONPATH: a worker host does not see this checkout's sources."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def make_worker_venv(path: Path) -> Path:
    """A venv at `path` that imports this interpreter's third-party libraries, not pgcascade.

    The .pth line puts our site-packages on its path without running that directory's own .pth
    files, so pgcascade's editable install is not on it; with any other install (or PYTHONPATH
    pointing at the sources) the probe below refuses to go on."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = Path(
        subprocess.check_output(
            [str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = path / "bin" / "python"
    probe = subprocess.run(
        [str(python), "-c", "import pgcascade"], capture_output=True, text=True, env=without_pythonpath()
    )
    if probe.returncode == 0:
        raise RuntimeError(f"{python} imports pgcascade: the worker venv must not")
    return python


@dataclass
class SparkCluster:
    """A standalone master here and one worker per NetHost."""

    workdir: Path
    hosts: list[NetHost] = field(default_factory=list)
    worker_cores: int = 2
    worker_memory: str = "2g"
    procs: list[subprocess.Popen] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    webui_port: int = field(default_factory=free_port)
    python: Path | None = None

    @property
    def address(self) -> str:
        return self.hosts[0].gateway

    @property
    def master_url(self) -> str:
        return f"spark://{self.address}:{self.port}"

    def _env(self, local_ip: str) -> dict[str, str]:
        return {
            **without_pythonpath(),
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": local_ip,
            "SPARK_LOG_DIR": str(self.workdir),
            "SPARK_WORKER_DIR": str(self.workdir / "work"),
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
            # the master and worker only schedule and launch: start them cheaply (C1 JIT, serial GC)
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        }

    def start(self, hosts: int = 1) -> SparkCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for i in range(hosts):
            self.hosts.append(NetHost.free(f"pgc-{os.getpid()}-{i}").create())
        self.python = make_worker_venv(self.workdir / "worker-venv")
        spark_class = str(spark_home() / "bin" / "spark-class")
        log = (self.workdir / "master.log").open("w")
        self.procs.append(
            subprocess.Popen(
                [
                    spark_class,
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    self.address,
                    "--port",
                    str(self.port),
                    "--webui-port",
                    str(self.webui_port),
                ],
                env=self._env(self.address),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        wait_until(lambda: self.state() is not None, 60, what="the Spark master's web UI")
        for i, host in enumerate(self.hosts):
            wlog = (self.workdir / f"worker-{i}.log").open("w")
            self.procs.append(
                host.run(
                    [
                        spark_class,
                        "org.apache.spark.deploy.worker.Worker",
                        "--host",
                        host.address,
                        "--cores",
                        str(self.worker_cores),
                        "--memory",
                        self.worker_memory,
                        "--webui-port",
                        str(free_port()),
                        self.master_url,
                    ],
                    env=self._env(host.address),
                    stdout=wlog,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        wait_until(
            lambda: (self.state() or {}).get("aliveworkers") == hosts,
            90,
            what="the Spark workers registered with the master",
        )
        return self

    def state(self) -> dict | None:
        """The master's JSON (workers, cores, active and completed applications)."""
        try:
            with urllib.request.urlopen(f"http://{self.address}:{self.webui_port}/json/", timeout=3) as r:
                return json.load(r)
        except (OSError, ValueError):  # ValueError: the UI's HTML page, served before its JSON is
            return None

    def applications(self) -> list[dict]:
        s = self.state() or {}
        return s.get("activeapps", []) + s.get("completedapps", [])

    def close(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        for h in self.hosts:
            h.destroy()
