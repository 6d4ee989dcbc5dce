"""The live page of `serve`, in a real headless Chromium (Debian's, driven by Playwright), on a
root, a branch and a leaf with their daemons running: during a copy held mid-stream, while a
paused branch falls behind, across a switchover, and with the leaf's worker killed.  The
page's words are what is asserted;
/api/topology and the /metrics of serve and of the leaf's worker are read alongside.
Screenshots are written to .artifacts/screenshots and their paths printed."""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from conftest import scrape, value
from playwright.sync_api import Page, expect, sync_playwright
from test_cascade import QUEUE, cascade, copy_schema  # noqa: F401 - the cascade fixture
from test_replication import PGBENCH_TABLES, pgbench, pgbench_init

from pgcascade.dev.localcluster import free_port, wait_until

CHROMIUM = "/usr/bin/chromium"  # Debian's package, installed by scripts/install.sh
# as root in a closed network: no sandbox, and none of Chromium's own connections out
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = Path(__file__).resolve().parents[2] / ".artifacts" / "screenshots"
SECRET = "s3cr3t-never-shown"
ACCOUNTS = "public.pgbench_accounts"


@dataclass
class WithPassword:
    """A database whose connection string carries a password (trust auth ignores it): the
    page and the API must never show it."""

    db: object

    @property
    def connstr(self) -> str:
        return f"{self.db.connstr} password={SECRET}"  # type: ignore[attr-defined]

    def connect(self, autocommit: bool = True):
        return self.db.connect(autocommit)  # type: ignore[attr-defined]


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def lag_seconds(text: str) -> float:
    """The lag the graph shows for a node, 'lag 1.2 s' / 'lag 340 ms' / 'lag 2.0 min'."""
    m = re.search(r"lag ([\d.]+) (ms|s|min|h)", text)
    assert m, text
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "min": 60, "h": 3600}[m.group(2)]


def test_page_follows_a_copy_a_lagging_branch_and_a_switchover(cascade, make_db):
    c = cascade
    serve_port, worker_port = free_port(), free_port()
    c.node("s1", make_db("a"), serve_refresh=0.3)
    c.node("s2", make_db("b"))
    c.node("s3", WithPassword(make_db("b")), metrics_port=worker_port)
    pgbench_init(c.dbs["s1"])
    for n in ("s2", "s3"):
        copy_schema(c.dbs["s1"], c.dbs[n])
    c.create("s1", "root")
    c.run("s1", "add-table", *PGBENCH_TABLES)
    c.run("s1", "add-seq", "--all")
    c.create("s2", "branch", "s1")
    c.create("s3", "leaf", "s1")
    c.run("s2", "add-table", "--all")
    c.run("s2", "add-seq", "--all")
    for n in ("s1", "s2", "s3"):
        c.start_ticker(n)
    c.start_worker("s1")
    c.start_worker("s2")
    # the leaf's copy of pgbench_accounts holds still after its first MB, COPY open
    c.workers["s3"] = c.daemons.start(
        str(c.ini("s3")),
        "worker",
        env={
            "PGCASCADE_PAUSE_AT": "copy-stream",
            "PGCASCADE_PAUSE_TABLE": ACCOUNTS,
            "PGCASCADE_PAUSE_SECONDS": "15",
        },
    )
    c.daemons.start(str(c.ini("s1")), "serve", "--port", str(serve_port))
    wait_until(lambda: _healthy(serve_port), 90, what="serve's /healthz")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(f"http://127.0.0.1:{serve_port}/")
        expect(page.get_by_test_id("set-name")).to_have_text(f"set {QUEUE}")
        graph = page.get_by_test_id("graph")
        for n in ("s1", "s2", "s3"):
            expect(graph.locator(f'[data-node="{n}"]')).to_be_visible()
        for edge in ("s1->s2", "s1->s3"):
            expect(graph.locator(f'[data-edge="{edge}"]')).to_have_count(1)
        # the page is up before the leaf's copy starts: its 15 s pause is seen however slow the
        # browser was to start
        c.cli("s3", "add-table", "--all")

        # the copy in flight: a bar, rows done of the estimate, an ETA - and the same in /metrics
        copy_cell = page.get_by_test_id("tables-s3").locator(
            f'tr[data-table="{ACCOUNTS}"] [data-testid="copy"]'
        )
        expect(copy_cell).to_contain_text(re.compile(r"copying: [1-9]\d*/\d+ rows \d+%, ETA"), timeout=60_000)
        expect(
            page.get_by_test_id("tables-s3").locator(f'tr[data-table="{ACCOUNTS}"] [data-testid="state"]')
        ).to_have_text("in-copy")
        shot(page, "1-copy-in-flight")
        at_serve = scrape(serve_port)
        assert value(at_serve, "pgcascade_copy_rows", node="s3", table=ACCOUNTS) > 0
        assert value(at_serve, "pgcascade_copy_rows_estimated", node="s3", table=ACCOUNTS) == 100_000
        assert value(at_serve, "pgcascade_node_tables", node="s3", phase="in-copy") >= 1
        at_worker = scrape(worker_port)
        assert value(at_worker, "pgcascade_copy_rows", node="s3", table=ACCOUNTS) > 0
        assert (
            value(at_worker, "pgcascade_table_lag_seconds", node="s3", table="public.pgbench_branches") >= 0
        )

        # ... and the table moves to ok when the copy goes on
        expect(
            page.get_by_test_id("tables-s3").locator(f'tr[data-table="{ACCOUNTS}"] [data-testid="state"]')
        ).to_have_text("ok", timeout=90_000)
        expect(copy_cell).to_have_text("")

        # a paused branch under writes: its lag on the page grows, per node and per table
        c.cli("s2", "pause")
        load = pgbench(c.dbs["s1"], "-c", "2", "-T", "4", "-R", "100")
        lag_text = page.get_by_test_id("graph-lag-s2")
        first = lag_seconds(lag_text.text_content() or "")
        wait_until(
            lambda: lag_seconds(lag_text.text_content() or "") > first + 1.5,
            20,
            what="s2's lag to grow on the page",
        )
        table_lag = page.get_by_test_id("tables-s2").locator(
            'tr[data-table="public.pgbench_accounts"] [data-testid="lag"]'
        )
        wait_until(
            lambda: lag_seconds("lag " + table_lag.inner_text()) > 0.5, 20, what="a table lag on the page"
        )
        shot(page, "2-branch-paused")
        assert load.wait(timeout=60) == 0, load.stderr.read()
        c.cli("s2", "resume")
        c.sync("s1", ["s2", "s3"])

        # switchover: s2 becomes the root, s1 its branch; the graph follows
        c.cli("s2", "takeover", "s1", timeout=240)
        expect(graph.locator('[data-node="s2"]')).to_contain_text("s2 (root)", timeout=30_000)
        expect(graph.locator('[data-edge="s2->s1"]')).to_have_count(1, timeout=30_000)
        expect(graph.locator('[data-node="s1"]')).to_contain_text("s1 (branch)")
        shot(page, "3-after-switchover")

        # the leaf's worker killed: its box turns red at once, the errors name it; restarted, it clears
        c.kill_worker("s3")
        s3_box = graph.locator('[data-node="s3"]')
        expect(s3_box).to_have_class(re.compile(r"\bbad\b"), timeout=15_000)
        expect(page.get_by_test_id("graph-lag-s3")).to_have_text("worker not running")
        expect(page.get_by_test_id("errors")).to_contain_text(
            re.compile(r"s3 \(worker, [^)]+\): worker not running \(last seen [\d.]+ (ms|s) ago")
        )
        expect(page.get_by_test_id("facts-s3")).to_contain_text("worker: not running (last seen")
        assert value(scrape(serve_port), "pgcascade_node_daemon_critical", node="s3", role="worker") == 1
        shot(page, "4-leaf-worker-killed")
        c.start_worker("s3")
        expect(s3_box).not_to_have_class(re.compile(r"\bbad\b"), timeout=30_000)

        html = page.content()
        browser.close()

    topo = json.loads(get(serve_port, "/api/topology"))
    assert {n["name"]: (n["type"], n["provider"]) for n in topo["nodes"]} == {
        "s1": ("branch", "s2"),
        "s2": ("root", None),
        "s3": ("leaf", "s1"),
    }
    s3 = next(n for n in topo["nodes"] if n["name"] == "s3")
    assert "password" not in s3["location"]  # never stored (docs/operations.md, "Security")
    for text in (html, json.dumps(topo), get(serve_port, "/metrics")):
        assert SECRET not in text
    c.sync("s2", ["s1", "s3"])
    c.assert_equal("s2", "s1")
    c.assert_equal("s2", "s3")


def _healthy(port: int) -> bool:
    try:
        return json.loads(get(port, "/healthz"))["ok"] is True
    except OSError:
        return False


def test_serve_refusals_are_one_line(cascade, make_db):
    c = cascade
    c.node("s1", make_db("a"))
    r = c.cli("s1", "serve", "--port", str(free_port()), check=False)
    assert r.returncode == 2 and "not a node" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    c.create("s1", "root")
    port = free_port()
    first = c.daemons.start(str(c.ini("s1")), "serve", "--port", str(port))
    wait_until(lambda: _healthy(port), 30, what="serve's /healthz")
    r = c.cli("s1", "serve", "--port", str(port), check=False)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and first.poll() is None
