"""The web console (``console``) of a baked service in a real headless Chromium.

Debian's ``chromium`` (``.ci/run`` installs it) driven by Playwright for Python, against a
real redis-server and a real worker: the overview shows a queue's depth and a running
job; a dead letter is replayed with the token and refused without it (and by a read-only
console, whatever is posted to it); a hostile job argument and traceback (``<script>``,
``<img onerror>``) are shown as text and never run. Every response carries the security
headers.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from _lifecycle import QUEUE, Jobs, Worker, get, lc_project, started, wait_for, workers
from bakery import PYTHON, free_port, package_of, project_env
from dramatiq import Message
from test_malformed import counted

__all__ = ["lc_project", "workers"]

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "s3cret-token"
HOSTILE = "<script>document.title='pwned';window.pwned=1</script><img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        found = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield found
        found.close()


class Console:
    """``python -m <package> console --port P`` with ``env``; killed at teardown."""

    def __init__(self, project: Path, redis_url: str, directory: Path, **env: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "console.log"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [PYTHON, "-m", package_of(project), "console", "--port", str(self.port)],
                cwd=project, env=project_env(project, REDIS_URL=redis_url, **env), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: self._answers(), 30, "the console to answer")

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the console exited: {self.log_path.read_text()}")
        try:
            return get(self.url + "/")[0] == 200
        except OSError:
            return False

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()
                if line.startswith("{")]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


def screen(browser: Any, width: int, **options: Any) -> Any:
    """A browser context ``width`` px wide; below 640 px a phone's, as Chromium emulates one
    (mobile, 3 device pixels a CSS pixel, touch): a page without a viewport meta is laid out
    980 px wide there and shrunk, so the tests at 390 px fail without one."""
    mobile = width < 640
    return browser.new_context(viewport={"width": width, "height": 900}, is_mobile=mobile,
                               device_scale_factor=3 if mobile else 1, has_touch=mobile,
                               **options)


@pytest.fixture
def consoles(lc_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Console] = []

    def start(**env: str) -> Console:
        made.append(Console(lc_project, redis_url, tmp_path / f"console{len(made)}", **env))
        return made[-1]

    yield start
    for console in made:
        console.stop()


def kill_letter(client: redis.Redis, queue: str, actor: str, *args: Any, reason: str,
                traceback: str | None = None, kwargs: dict[str, Any] | None = None,
                redis_id: str | None = None) -> str:
    """A dead letter of ``queue`` as the worker leaves one (kept under ``redis_id``, default
    its job id); returns its redis id."""
    message: Message[Any] = Message(queue_name=queue, actor_name=actor, args=args,
                                    kwargs=kwargs or {}, options={})
    redis_id = redis_id or message.message_id
    options = {"redis_message_id": redis_id, "dead_letter_reason": reason, "retries": 4}
    if traceback:
        options["traceback"] = traceback
    client.zadd(f"dramatiq:{queue}.XQ", {redis_id: int(time.time() * 1000)})
    client.hset(f"dramatiq:{queue}.XQ.msgs", redis_id, message.copy(options=options).encode())
    return redis_id


def replay_in(page: Any, url: str, redis_id: str, token: str) -> int:
    """Open the dead letters at ``url``, select ``redis_id``, sign as alice with ``token``,
    confirm and press replay: the status of the answer."""
    page.goto(url)
    page.check(f"input[name=id][value='{redis_id}']")
    page.fill("input[name=who]", "alice")
    page.fill("input[name=token]", token)
    page.check("input[name=confirm]")
    with page.expect_response(lambda r: r.url.endswith("/dead/act")) as response:
        page.click("button[value=replay]")
    return int(response.value.status)


@contextlib.contextmanager
def one_job_running(project: Path, redis_url: str, folder: Path, jobs: Jobs, count: int,
                    heartbeat_ms: str) -> Iterator[Worker]:
    """A worker of one thread running the first of ``count`` long jobs (the others wait);
    killed on the way out."""
    for process in started(lambda: Worker(project, redis_url, folder, WORKER_CONCURRENCY="1",
                                          WORKER_PREFETCH="1",
                                          WORKER_HEARTBEAT_TIMEOUT_MS=heartbeat_ms)):
        worker = process()
        wait_for(lambda: worker.children(), 30, "the worker process")
        jobs.many("lc_long", count, 60)
        wait_for(lambda: jobs.starts("j0"), 30, "the first job to start")
        yield worker


def test_the_overview_shows_a_queue_depth_and_a_running_job(
        browser: Any, consoles: Any, lc_project: Path, redis_url: str, tmp_path: Path) -> None:
    jobs = Jobs(redis_url)
    with one_job_running(lc_project, redis_url, tmp_path / "w", jobs, 4, "2000") as worker:
        console = consoles()
        page = browser.new_page()
        try:
            def shown() -> bool:
                page.goto(console.url + "/")
                row = page.locator("table").first.locator("tr", has_text=QUEUE)
                return ("lc_long " in page.inner_text("body")
                        and row.locator("td").nth(3).inner_text() == "3")
            wait_for(shown, 15, "the overview to show 3 waiting and lc_long running")
            body = page.inner_text("body")
            assert "interactive" in body and str(worker.children()[0]) in body
            assert "Read-only: set CONSOLE_TOKEN" in body
            in_flight = page.locator("table").first.locator("tr", has_text=QUEUE).locator("td")
            assert in_flight.nth(6).inner_text() == "1"
        finally:
            page.close()


def test_a_dead_letter_is_replayed_with_the_token_and_refused_without_it(
        browser: Any, consoles: Any, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    kept = kill_letter(client, "reports", "build_report", 1, reason="KeyError: 'q3'")
    chosen = kill_letter(client, "reports", "build_report", 2, reason="KeyError: 'q4'")
    console = consoles(CONSOLE_TOKEN=TOKEN)
    page = browser.new_page()
    try:
        page.goto(f"{console.url}/dead?queue=reports")
        assert "2 dead letters on reports" in page.inner_text("body")

        def submit(token: str) -> int:
            return replay_in(page, f"{console.url}/dead?queue=reports", chosen, token)

        assert submit("wrong-token") == 403
        assert "Refused: wrong or missing token; nothing was changed" in page.inner_text("body")
        assert client.zcard("dramatiq:reports.XQ") == 2 and client.llen("dramatiq:reports") == 0

        assert submit(TOKEN) == 200
        assert "Replayed 1 of 1 selected dead letters" in page.inner_text("body")
        assert client.zrange("dramatiq:reports.XQ", 0, -1) == [kept.encode()]
        [new_id] = client.lrange("dramatiq:reports", 0, -1)
        replayed = Message.decode(client.hget("dramatiq:reports.msgs", new_id))
        assert replayed.args == (2,) and replayed.options["replays"] == 1
        actions = [r for r in console.records() if r.get("event") == "console_action"]
        assert [(r["outcome"], r["who"], r["ids"]) for r in actions] == [
            ("refused", "alice", [chosen]), ("replayed", "alice", [chosen])]
        assert all(r["remote"] == "127.0.0.1" for r in actions)
    finally:
        page.close()

    # A read-only console shows no form and refuses a crafted post, token or not.
    read_only = consoles()
    page = browser.new_page()
    try:
        page.goto(f"{read_only.url}/dead?queue=reports")
        assert page.locator("input[name=token]").count() == 0
        assert "Read-only" in page.inner_text("body")
        crafted = page.request.post(f"{read_only.url}/dead/act", form={
            "queue": "reports", "id": kept, "token": TOKEN, "confirm": "yes", "who": "mallory",
            "action": "purge"})
        assert crafted.status == 403 and "read-only" in crafted.text()
        assert client.zrange("dramatiq:reports.XQ", 0, -1) == [kept.encode()]
    finally:
        page.close()


def test_typed_arguments_show_and_one_failure_of_many_jobs_is_one_row(
        browser: Any, consoles: Any, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for number in range(5):
        kill_letter(client, "notifications", "send_notification",
                    reason=f"ValueError: template 'promo-{number}' of user {100 + number} failed",
                    kwargs={"user_id": 100 + number, "template": f"promo-{number}"})
    console = consoles()
    page = browser.new_page()
    try:
        page.goto(f"{console.url}/dead?queue=notifications")
        cells = page.locator("table tbody tr td:nth-child(6)")
        assert cells.count() == 5
        assert cells.first.inner_text() == 'user_id=100, template="promo-0"'
        page.fill("input[name=find]", "PROMO-3")  # any case, in the reason
        page.click("text=Filter")
        assert page.locator("table tbody tr").count() == 1
        assert "5 dead letters on notifications; 1 of them match 'PROMO-3'" in (
            page.inner_text("body"))
        assert 'template="promo-3"' in page.inner_text("table tbody tr")
        page.goto(f"{console.url}/dead/summary?queue=notifications")
        rows = page.locator("table tbody tr")
        assert rows.count() == 1
        assert [rows.first.locator("td").nth(i).inner_text() for i in range(1, 5)] == [
            "5", "send_notification", "ValueError", "template '…' of user <n> failed"]
    finally:
        page.close()


#: Where the page tests leave their screenshots (beside the test's own files: tmp_path).
WIDTHS = (1400, 390)


def test_every_page_fits_both_widths_in_light_and_dark_and_refreshes_without_script(
        browser: Any, consoles: Any, lc_project: Path, redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = Jobs(redis_url)
    kill_letter(client, "notifications", "send_notification", reason="ValueError: user 7 gone",
                kwargs={"user_id": 7, "template": "welcome"})
    jobs.broker.enqueue(Message(queue_name="partner", actor_name="call_partner", args=(),
                                kwargs={"order_id": "o-1", "amount": 12.5}, options={}))
    retry = Message(queue_name="notifications", actor_name="lc_quick", args=("r1",), kwargs={},
                    options={"retries": 2})
    jobs.broker.enqueue(retry, delay=600_000)
    client.set("dramatiq:__capacity__.reports", capacity_result("build_report", [
        {"concurrency": c, "jobs_per_s": r, "gain": None, "rounds": [r]}
        for c, r in ((1, 9.5), (2, 18.9), (4, 20.1))], 2))
    with one_job_running(lc_project, redis_url, tmp_path / "w", jobs, 2, "5000"):
        console = consoles()
        pages = {
            "overview": "/?refresh=5",
            "waiting": "/jobs?queue=partner",
            "delayed": "/jobs?queue=notifications&kind=delayed",
            "dead": "/dead?queue=notifications",
            "summary": "/dead/summary?queue=notifications",
            "show": "/dead/show?queue=notifications&id=" + client.zrange(
                "dramatiq:notifications.XQ", 0, 0)[0].decode(),
            "schedules": "/schedules",
            "capacity": "/capacity",
            "activity": "/activity",
        }
        for width in WIDTHS:
            for scheme in ("light", "dark"):
                context = screen(browser, width, color_scheme=scheme)
                page = context.new_page()
                try:
                    for name, path in pages.items():
                        response = page.goto(console.url + path)
                        assert response is not None and response.status == 200, path
                        assert page.locator("script").count() == 0, path
                        fits(page, width, name)
                        background = page.evaluate(
                            "getComputedStyle(document.body).backgroundColor")
                        dark = background == "rgb(22, 24, 28)"
                        assert dark == (scheme == "dark"), (name, scheme, background)
                        page.screenshot(path=str(tmp_path / f"{name}-{width}-{scheme}.png"),
                                        full_page=True)
                    page.goto(console.url + pages["overview"])
                    body = page.inner_text("body")
                    assert "Unserved: queue partner (pool external): 1 waiting" in body
                    assert "lc_long " in body and "Auto-refresh every 5 s" in body
                    refresh = page.locator("meta[http-equiv=refresh]")
                    assert refresh.get_attribute("content") == "5"
                    if width == 390:  # a row is a card: every value under its column's name
                        cell = page.locator("td[data-label='dead letters']").first
                        assert cell.is_visible() and cell.bounding_box()["x"] < 390
                    page.goto(console.url + pages["capacity"])
                    chart = page.locator("svg").bounding_box()
                    assert chart is not None and chart["x"] + chart["width"] <= width, chart
                    assert f"Warning: {NOISE}." in page.inner_text("body")
                    page.goto(console.url + pages["waiting"])
                    assert 'order_id="o-1", amount=12.5' in page.inner_text("body")
                    page.goto(console.url + pages["delayed"])
                    row = page.locator("table tbody tr", has_text="lc_quick").inner_text()
                    assert "retry 2" in row and "from now" in row, row
                finally:
                    context.close()
        page = browser.new_page()
        try:
            page.goto(console.url + "/")
            assert page.locator("meta[http-equiv=refresh]").count() == 0
            page.click("text=5 s")
            assert page.url.endswith("/?refresh=5")
        finally:
            page.close()


def test_the_activity_page_charts_the_last_hour_from_the_workers_counts(
        browser: Any, consoles: Any, workers: Any, redis_url: str) -> None:
    jobs = Jobs(redis_url)
    worker = workers(WORKER_HEARTBEAT_TIMEOUT_MS="2000")
    wait_for(lambda: worker.children(), 30, "the worker process")
    jobs.many("lc_quick", 6)
    jobs.enqueue("lc_sleep", "no-seconds")  # a TypeError: failed, then retried
    wait_for(lambda: jobs.done_count() == 6, 30, "the 6 jobs")
    console = consoles()
    page = browser.new_page()
    try:
        def charted() -> bool:
            page.goto(console.url + "/activity")
            section = page.locator("section.activity", has_text=QUEUE)
            said = section.locator("p").inner_text()
            return said.startswith("Last hour: 6 done, ") and " 0 failed" not in said
        wait_for(charted, 30, "the last hour's counts on the page", step=0.5)
        chart = page.locator("section.activity", has_text=QUEUE).locator("svg")
        assert chart.locator("rect.done").count() >= 1
        assert chart.locator("rect.failed").count() >= 1
        assert chart.locator("polyline.age").count() == 1
        assert page.locator("script").count() == 0
        quiet = page.locator("section.activity", has_text="reports").locator("p").inner_text()
        assert quiet.startswith("Last hour: 0 done, 0 failed"), quiet
        # Bounded: a hash a queue a minute, each gone after the hour (and a few minutes).
        client = redis.Redis.from_url(redis_url)
        kept = list(client.scan_iter("dramatiq:__activity__.*"))
        assert kept and all(0 < client.pttl(key) <= 65 * 60_000 for key in kept), kept
    finally:
        page.close()


def sign_and_press(page: Any, button: str, token: str, posted: str) -> int:
    """Sign the form of ``button`` (the overview has two) as alice with ``token``, confirm,
    press ``button``: the status of the answer to ``posted``."""
    form = page.locator(f"form:has(button[value={button}])")
    form.locator("input[name=who]").fill("alice")
    form.locator("input[name=token]").fill(token)
    form.locator("input[name=confirm]").check()
    with page.expect_response(lambda r: r.url.endswith(posted)) as response:
        form.locator(f"button[value={button}]").click()
    page.wait_for_load_state("load")  # the answer's stylesheet too (a narrow page's cards)
    return int(response.value.status)


def test_a_group_is_replayed_and_a_waiting_job_cancelled_with_the_token(
        browser: Any, consoles: Any, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for number in range(5):
        kill_letter(client, "reports", "build_report", number,
                    reason=f"KeyError: 'q{number}' in report {number}")
    other = kill_letter(client, "reports", "build_report", 9, reason="ValueError: no rows")
    waiting = Message(queue_name="partner", actor_name="call_partner", args=(), kwargs={},
                      options={})
    Jobs(redis_url).broker.enqueue(waiting)
    console = consoles(CONSOLE_TOKEN=TOKEN)
    page = browser.new_page()
    try:
        page.goto(f"{console.url}/dead/summary?queue=reports")
        group = page.locator("tr", has_text="KeyError").locator("input[name=group]")
        group.check()
        assert sign_and_press(page, "replay-group", "wrong", "/dead/act") == 403
        assert client.zcard("dramatiq:reports.XQ") == 6
        page.locator("tr", has_text="KeyError").locator("input[name=group]").check()
        assert sign_and_press(page, "replay-group", TOKEN, "/dead/act") == 200
        assert "Replayed 5 dead letters of the group build_report / KeyError" in (
            page.inner_text("body"))
        assert client.zrange("dramatiq:reports.XQ", 0, -1) == [other.encode()]
        assert client.llen("dramatiq:reports") == 5

        page.goto(f"{console.url}/jobs?queue=partner")
        page.check(f"input[name=id][value='{waiting.message_id}']")
        assert sign_and_press(page, "cancel", TOKEN, "/jobs/act") == 200
        # Sent by bare Dramatiq, it is not in the message index: cancelled all the same.
        assert "Cancelled 1 selected jobs (0 found queued, delayed or running)" in (
            page.inner_text("body"))
        assert client.zscore("dramatiq:__cancelled__", waiting.message_id) is not None
        actions = [r for r in console.records() if r.get("event") == "console_action"]
        assert [(r["action"], r["outcome"], r.get("count")) for r in actions] == [
            ("replay-group", "refused", None), ("replay-group", "replayed", 5),
            ("cancel", "cancelled", 1)]
        assert actions[1]["group"][:3] == ["reports", "build_report", "KeyError"]
        assert actions[2]["ids"] == [waiting.message_id] and actions[2]["who"] == "alice"
    finally:
        page.close()


def test_a_hostile_argument_and_traceback_are_shown_inert(
        browser: Any, consoles: Any, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    redis_id = kill_letter(client, "reports", "build_report", HOSTILE, reason=HOSTILE,
                           traceback=f"Traceback (most recent call last):\n</pre>{HOSTILE}")
    console = consoles(CONSOLE_TOKEN=TOKEN)
    page = browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    try:
        for path in ("/dead?queue=reports", f"/dead/show?queue=reports&id={redis_id}",
                     "/dead/summary?queue=reports"):
            response = page.goto(console.url + path)
            assert response is not None and response.status == 200, path
            headers = response.headers
            assert headers["content-security-policy"].startswith("default-src 'none'"), path
            assert headers["x-frame-options"] == "DENY"
            assert headers["x-content-type-options"] == "nosniff"
            # shown as text (the summary masks its quoted value: one row per kind)
            assert "<script>document.title='" in page.inner_text("body"), path
            assert page.locator("script").count() == 0, path
            assert page.locator("img").count() == 0, path
            assert page.title() != "pwned" and page.evaluate("window.pwned") is None, path
        page.goto(f"{console.url}/dead/show?queue=reports&id={redis_id}")
        show = page.locator("pre").first.inner_text()
        assert show.startswith("Traceback (most recent call last):\n</pre><script>"), show
        assert dialogs == []
    finally:
        page.close()


def test_the_console_logs_as_log_format_says(consoles: Any) -> None:
    desk = consoles(LOG_FORMAT="console")
    [line] = [line for line in desk.log_path.read_text().splitlines() if "console on" in line]
    assert not line.startswith("{") and " INFO    console on http://127.0.0.1:" in line, line
    assert "event=console_start" in line, line
    production = consoles()
    assert [r["event"] for r in production.records()] == ["console_start"]


def test_the_console_binds_localhost_and_names_a_busy_port(lc_project: Path,
                                                           redis_url: str) -> None:
    done = subprocess.run([PYTHON, "-m", package_of(lc_project), "console", "--help"],
                          cwd=lc_project, env=project_env(lc_project), capture_output=True,
                          text=True, timeout=30)
    assert "--host" in done.stdout and "127.0.0.1" in done.stdout and "9292" in done.stdout
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        refused = subprocess.run(
            [PYTHON, "-m", package_of(lc_project), "console", "--port", str(port)],
            cwd=lc_project, env=project_env(lc_project, REDIS_URL=redis_url),
            capture_output=True, text=True, timeout=30)
    assert refused.returncode == 78
    assert f"console: cannot listen on 127.0.0.1:{port}" in refused.stderr


NOISE = ("the rounds of concurrency 2 differ by up to 198%: something else ran on this "
         "machine, and the verdict may be wrong; measure again where nothing else runs")


def capacity_result(actor: str, levels: list[Any], knee: Any) -> bytes:
    """A stored ``capacity`` result as the command writes it (tests/test_capacity.py checks
    the command writes this shape at this key)."""
    return json.dumps({"actor": actor, "queue": "reports", "pool": "batch", "jobs": 64,
                       "rounds": 3, "min_gain": 0.1, "levels": levels, "stops_rising_at": knee,
                       "noisy": [2], "warnings": [NOISE], "verdict": "throughput stops rising",
                       "measured_at_ms": 1_700_000_000_000}).encode()


def test_the_capacity_page_charts_the_stored_result_inert(
        browser: Any, consoles: Any, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    levels = [{"concurrency": c, "jobs_per_s": rate, "gain": None, "rounds": rounds}
              for c, rate, rounds in ((1, 9.5, [9.5, 9.1, 8.7]), (2, 18.9, [18.9, 17.0, 18.2]),
                                      (4, 20.1, [20.1, 19.5, 19.9]))]
    levels.append({"concurrency": 8, "jobs_per_s": "NaN<img src=x onerror=alert(2)>"})
    client.set(f"dramatiq:__capacity__.{QUEUE}", b"not json <script>alert(3)</script>")
    console = consoles()
    page = browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    try:
        response = page.goto(console.url + "/capacity")
        assert response is not None and response.status == 200
        assert "No capacity result stored" not in page.inner_text("body")
        assert "The stored result is not readable" in page.inner_text("body")
        assert page.locator("svg").count() == 0
        client.set("dramatiq:__capacity__.reports", capacity_result(HOSTILE, levels, 2))
        response = page.goto(console.url + "/capacity")
        assert response is not None and response.status == 200
        assert response.headers["content-security-policy"].startswith("default-src 'none'")
        chart = page.locator("svg")
        assert chart.count() == 1 and chart.get_attribute("role") == "img"
        assert chart.bounding_box()["width"] > 300  # type: ignore[index]
        # One point per level of numbers (the garbled level is left out), each round a dot,
        # the level where throughput stops rising marked, and the line through the points.
        assert chart.locator("circle.level").count() == 3
        assert chart.locator("circle.round").count() == 9
        assert chart.locator("line.knee").count() == 1
        heights = [float(chart.locator("circle.level").nth(i).get_attribute("cy") or "")
                   for i in range(3)]
        assert heights[0] > heights[1] > heights[2]  # higher rate, higher on the page
        knee_x = chart.locator("line.knee").get_attribute("x1")
        assert knee_x == chart.locator("circle.level").nth(1).get_attribute("cx")
        assert len((chart.locator("polyline.best").get_attribute("points") or "").split()) == 3
        body = page.inner_text("body")
        assert "Throughput stops rising at concurrency 2." in body and "2023-11-14T" in body
        assert f"Warning: {NOISE}." in body  # what the command printed beside its verdict
        assert "<script>document.title='pwned'" in body  # the hostile actor name, as text
        assert page.locator("script").count() == 0 and page.locator("img").count() == 0
        assert page.title() != "pwned" and page.evaluate("window.pwned") is None
        rows = page.locator("table").first.locator("tbody tr")
        assert [rows.nth(i).locator("td").first.inner_text() for i in range(3)] == [
            "1", "2", "4"]
        assert dialogs == []
    finally:
        page.close()


def test_the_exporter_mounts_the_console_only_when_asked(
        browser: Any, workers: Any, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    kept = kill_letter(client, "reports", "build_report", 1, reason="KeyError: 'q5'")
    chosen = kill_letter(client, "reports", "build_report", 2, reason="KeyError: 'q6'")
    plain = workers()
    read_only = workers(CONSOLE_IN_EXPORTER="true")
    acting = workers(CONSOLE_IN_EXPORTER="true", CONSOLE_TOKEN=TOKEN)

    def serving(worker: Worker) -> bool:
        try:
            return "queue_depth" in worker.metrics()
        except OSError:
            return False

    for worker in (plain, read_only, acting):
        wait_for(lambda w=worker: serving(w), 60, "the exporter to serve")
    # Off by default: the exporter serves its own paths only.
    assert get(f"http://127.0.0.1:{plain.port}/console/")[0] == 404
    assert not plain.records("console_start")
    page = browser.new_page()
    try:
        base = f"http://127.0.0.1:{read_only.port}/console"
        response = page.goto(base + "/")
        assert response is not None and response.status == 200
        headers = response.headers
        assert headers["content-security-policy"].startswith("default-src 'none'")
        assert headers["x-frame-options"] == "DENY" and headers["cache-control"] == "no-store"
        assert "Read-only: set CONSOLE_TOKEN" in page.inner_text("body")
        # Every link stays under the mount (the stylesheet too).
        hrefs = page.eval_on_selector_all("a, link", "els => els.map(e => e.getAttribute('href'))")
        assert hrefs and all(href.startswith("/console/") for href in hrefs), hrefs
        page.click("text=Capacity")
        assert page.url == base + "/capacity"
        page.goto(f"{base}/dead?queue=reports")
        assert "2 dead letters on reports" in page.inner_text("body")
        assert page.locator("input[name=token]").count() == 0
        crafted = page.request.post(f"{base}/dead/act", form={
            "queue": "reports", "id": kept, "token": TOKEN, "confirm": "yes", "who": "mallory",
            "action": "purge"})
        assert crafted.status == 403 and "read-only" in crafted.text()
        assert client.zcard("dramatiq:reports.XQ") == 2
        assert "queue_depth" in read_only.metrics()  # /metrics beside it, unchanged

        # With CONSOLE_TOKEN in the worker's environment, the mounted console acts.
        base = f"http://127.0.0.1:{acting.port}/console"
        assert replay_in(page, f"{base}/dead?queue=reports", chosen, TOKEN) == 200
        assert "Replayed 1 of 1 selected dead letters" in page.inner_text("body")
        assert client.zrange("dramatiq:reports.XQ", 0, -1) == [kept.encode()]
        [action] = acting.records("console_action")
        assert (action["outcome"], action["who"], action["ids"]) == ("replayed", "alice",
                                                                     [chosen])
        [started_line] = acting.records("console_start")
        assert "actions enabled" in started_line["msg"]
        assert "read-only" in read_only.records("console_start")[0]["msg"]
    finally:
        page.close()


def fits(page: Any, width: int, what: str) -> None:
    """``page`` is laid out ``width`` px wide (on a phone's screen, only its viewport meta
    does that) and nothing of it sticks out (no sideways scroll)."""
    laid_out = page.evaluate("window.innerWidth")
    assert laid_out == width, f"{what} is laid out {laid_out} px wide on a {width} px screen"
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    wide = page.evaluate("Array.from(document.body.querySelectorAll('*')).filter(e => "
                         "e.getBoundingClientRect().right > window.innerWidth).map(e => "
                         "e.tagName + ' ' + (e.textContent || '').slice(0, 60))")
    assert overflow <= 0, f"{what} at {width} px overflows by {overflow} px: {wide}"


def test_every_action_works_at_both_widths_with_the_token_and_is_audited(
        browser: Any, consoles: Any, redis_url: str, tmp_path: Path) -> None:
    """Each action a form offers, done as an operator would at 1400 and at 390 px: replay
    and purge the selected dead letters (a list, one letter's page), replay a summary group,
    replay and purge every letter matching a filter, cancel a waiting and a delayed job,
    pause and resume a queue (refused with a wrong token first); each answered, each in
    Redis, each on its page without a sideways scroll, each one ``console_action`` line."""
    client = redis.Redis.from_url(redis_url)
    console = consoles(CONSOLE_TOKEN=TOKEN)
    jobs = Jobs(redis_url)
    dead = "dramatiq:reports.XQ"
    expected: list[tuple[str, str, int | None]] = []
    for width in WIDTHS:
        client.flushall()
        chosen = kill_letter(client, "reports", "build_report", 1, reason="TimeoutError: slow")
        purged = kill_letter(client, "reports", "build_report", 2, reason="TimeoutError: down")
        shown = kill_letter(client, "reports", "build_report", 3, reason="RuntimeError: once")
        for number in range(3):
            kill_letter(client, "reports", "build_report", number,
                        reason=f"KeyError: 'q{number}' in report {number}")
        acme = [kill_letter(client, "reports", "build_report", n,
                            reason=f"ValueError: tenant acme-{n} has no rows") for n in range(3)]
        beta = [kill_letter(client, "reports", "build_report", n,
                            reason=f"OSError: disk beta-{n} full") for n in range(2)]
        invoice = kill_letter(client, "reports", "send_invoice", 5, reason="ValueError: x",
                              redis_id=f"redis-{width}")
        job_id = Message.decode(client.hget(f"{dead}.msgs", invoice)).message_id
        waiting = Message(queue_name="partner", actor_name="call_partner", args=(),
                          kwargs={"order_id": "o-9"}, options={})
        jobs.broker.enqueue(waiting)
        later = Message(queue_name="notifications", actor_name="lc_quick", args=("d",),
                        kwargs={}, options={})
        jobs.broker.enqueue(later, delay=600_000)
        context = screen(browser, width)
        page = context.new_page()

        def done(name: str, status: int, said: str, w: int = width, p: Any = page) -> None:
            """The answer to action ``name``: 200, saying ``said``, inert, fitting ``w`` px."""
            assert status == 200, (name, w, p.inner_text("body"))
            assert said in p.inner_text("body"), (name, w, p.inner_text("body"))
            assert p.locator("script").count() == 0
            fits(p, w, name)
            p.screenshot(path=str(tmp_path / f"action-{name}-{w}.png"), full_page=True)

        def act(name: str, path: str | None, box: str | None, button: str, said: str,
                w: int = width, p: Any = page) -> None:
            """Open ``path`` (None: stay), tick ``box`` (a selector, or None), sign and press
            ``button``: answered 200 saying ``said``."""
            if path is not None:
                p.goto(console.url + path)
                fits(p, w, f"the form of {path}")
            if box is not None:
                p.check(box)
            posted = "/jobs/act" if button == "cancel" else "/dead/act"
            done(name, sign_and_press(p, button, TOKEN, posted), said)

        try:
            act("replay", "/dead?queue=reports", f"input[name=id][value='{chosen}']", "replay",
                "Replayed 1 of 1 selected dead letters")
            act("purge", None, f"input[name=id][value='{purged}']", "purge",
                "Purged 1 of 1 selected dead letters")
            assert not {chosen, purged} & {m.decode() for m in client.zrange(dead, 0, -1)}
            act("purge-one", f"/dead/show?queue=reports&id={shown}", None, "purge",
                "Purged 1 of 1 selected dead letters")
            assert client.zscore(dead, shown) is None
            act("replay-group", "/dead/summary?queue=reports",
                "tr:has-text('KeyError') input[name=group]", "replay-group",
                "Replayed 3 dead letters of the group build_report / KeyError")

            for sought in ("SEND_INVOICE", job_id, f"redis-{width}"):  # actor, job id, redis id
                query = urllib.parse.urlencode({"queue": "reports", "find": sought})
                page.goto(f"{console.url}/dead?{query}")
                assert page.locator("table tbody tr").count() == 1, sought
                assert "send_invoice" in page.inner_text("table tbody tr"), sought
            page.goto(f"{console.url}/dead?queue=reports&find=ACME")
            assert page.locator("button[value=replay-matching]").inner_text() == (
                "Replay all 3 matching")
            act("replay-matching", "/dead?queue=reports&find=ACME", None, "replay-matching",
                "Replayed 3 dead letters matching 'ACME'")
            act("purge-matching", "/dead?queue=reports&find=beta", None, "purge-matching",
                "Purged 2 dead letters matching 'beta'")
            left = {m.decode() for m in client.zrange(dead, 0, -1)}
            assert left == {invoice}, left  # every other letter acted on, each by one action
            assert client.llen("dramatiq:reports") == 1 + 3 + 3, "the replayed ones wait"
            assert not set(acme + beta) & left

            act("cancel", "/jobs?queue=partner", f"input[name=id][value='{waiting.message_id}']",
                "cancel", "Cancelled 1 selected jobs (")
            act("cancel-delayed", "/jobs?queue=notifications&kind=delayed",
                f"input[name=id][value='{later.message_id}']", "cancel",
                "Cancelled 1 selected jobs (")
            for message in (waiting, later):
                assert client.zscore("dramatiq:__cancelled__", message.message_id) is not None

            page.goto(f"{console.url}/")
            fits(page, width, "the overview's form")
            page.check("input[name=queue][value=notifications]")
            assert sign_and_press(page, "pause", "wrong", "/queues/act") == 403
            assert "Refused: wrong or missing token" in page.inner_text("body")
            signed = {"queue": "notifications", "action": "pause", "token": TOKEN}
            unconfirmed = page.request.post(f"{console.url}/queues/act",
                                            form={**signed, "who": "alice"})
            assert unconfirmed.status == 400 and "tick the confirmation box" in (
                unconfirmed.text())
            anonymous = page.request.post(f"{console.url}/queues/act",
                                          form={**signed, "confirm": "yes"})
            assert anonymous.status == 400 and "give your name" in anonymous.text()
            assert not client.hexists("dramatiq:__paused__", "notifications")
            page.check("input[name=queue][value=notifications]")
            done("pause", sign_and_press(page, "pause", TOKEN, "/queues/act"),
                 "Queue notifications: paused")
            assert client.hexists("dramatiq:__paused__", "notifications")
            row = page.locator("table").first.locator("tr", has_text="notifications")
            assert "paused" in row.inner_text()
            row.locator("input[name=queue]").check()
            done("resume", sign_and_press(page, "resume", TOKEN, "/queues/act"),
                 "Queue notifications: resumed")
            assert not client.hexists("dramatiq:__paused__", "notifications")
        finally:
            context.close()
        expected += [("replay", "replayed", 1), ("purge", "purged", 1), ("purge", "purged", 1),
                     ("replay-group", "replayed", 3), ("replay-matching", "replayed", 3),
                     ("purge-matching", "purged", 2), ("cancel", "cancelled", 1),
                     ("cancel", "cancelled", 1), ("pause", "refused", None),
                     ("pause", "refused", None), ("pause", "refused", None),
                     ("pause", "paused", 1), ("resume", "resumed", 1)]
    actions = [r for r in console.records() if r.get("event") == "console_action"]
    assert [(r["action"], r["outcome"], r.get("count")) for r in actions] == expected
    assert [r["who"] for r in actions] == (["alice"] * 10 + [""] + ["alice"] * 2) * 2
    assert all(r["remote"] == "127.0.0.1" for r in actions)
    assert [r["queue"] for r in actions if r["action"] in ("pause", "resume")] == [
        "notifications"] * 10
    assert [r["find"] for r in actions if r["action"].endswith("-matching")] == [
        "ACME", "beta"] * 2


def test_a_running_job_is_cancelled_from_the_overview_and_a_waiting_one_skipped(
        browser: Any, consoles: Any, lc_project: Path, redis_url: str, tmp_path: Path) -> None:
    """At 1400 and at 390 px, with a real worker of one thread: a waiting job cancelled on
    ``/jobs`` and the running one cancelled on the overview. The running handler is
    interrupted (it never ends), the waiting one is skipped when the worker takes it
    (never starts), both are counted ``cancelled`` and neither is retried, dead-lettered or
    left queued; the worker then runs the next job; each cancel is one audit line."""
    client = redis.Redis.from_url(redis_url)
    console = consoles(CONSOLE_TOKEN=TOKEN)
    expected: list[tuple[str, str, str, list[str]]] = []
    for width in WIDTHS:
        client.flushall()
        jobs = Jobs(redis_url)
        with one_job_running(lc_project, redis_url, tmp_path / f"w{width}", jobs, 2,
                             "2000") as worker:
            waiting = [m.message_id for m in jobs.queued() if m.args[0] == "j1"]
            assert len(waiting) == 1, "j1 waits (one thread, nothing prefetched)"
            running = client.lrange("test:start:j0", 0, -1)
            assert len(running) == 1
            context = screen(browser, width)
            page = context.new_page()
            try:
                page.goto(f"{console.url}/jobs?queue={QUEUE}")
                page.check(f"input[name=id][value='{waiting[0]}']")
                assert sign_and_press(page, "cancel", TOKEN, "/jobs/act") == 200
                # Sent by bare Dramatiq (not in the message index): cancelled all the same.
                assert "Cancelled 1 selected jobs (" in page.inner_text("body")

                def listed(p: Any = page) -> str | None:
                    """The id of the one running job the overview offers to cancel."""
                    p.goto(f"{console.url}/")
                    box = p.locator("input[name=id][aria-label^='select running job']")
                    return box.get_attribute("value") if box.count() == 1 else None
                wait_for(listed, 15, "the running job with a box on the overview")
                running_id = listed()
                assert running_id and running_id != waiting[0]
                fits(page, width, "the overview with a running job")
                page.check(f"input[name=id][value='{running_id}']")
                assert sign_and_press(page, "cancel", TOKEN, "/jobs/act") == 200
                body = page.inner_text("body")
                assert "Cancelled 1 selected jobs (" in body
                assert page.locator("script").count() == 0
                fits(page, width, "the answer to a running job's cancel")
                page.screenshot(path=str(tmp_path / f"cancel-running-{width}.png"),
                                full_page=True)
                wait_for(lambda: counted(worker.metrics(), "cancelled") == 2, 30,
                         "the running job interrupted and the waiting one skipped")
                jobs.enqueue("lc_quick", "after")
                wait_for(lambda j=jobs: j.dones("after"), 30, "the next job after the cancels")
                assert jobs.dones("j0") == [], "the running handler was interrupted"
                assert len(jobs.starts("j0")) == 1, "the interrupted job was not retried"
                assert jobs.starts("j1") == [], "the cancelled waiting job never started"
                text = worker.metrics()
                for outcome in ("failure", "retry", "dead_letter", "requeued"):
                    assert counted(text, outcome) == 0, outcome
                assert jobs.queued() == [] and jobs.delayed() == 0
                assert jobs.dead_letters() == [] and not jobs.stranded()
                wait_for(lambda: not listed(), 15, "the cancelled job gone from the overview")
            finally:
                context.close()
        expected += [("cancel", "cancelled", QUEUE, waiting),
                     ("cancel", "cancelled", QUEUE, [running_id])]
    actions = [r for r in console.records() if r.get("event") == "console_action"]
    assert [(r["action"], r["outcome"], r["queue"], r["ids"]) for r in actions] == expected
    assert [r.get("kind") for r in actions] == [None, "running"] * 2
    assert all(r["who"] == "alice" and r["remote"] == "127.0.0.1" for r in actions)


def test_the_waiting_and_delayed_jobs_filter_by_actor_and_job_id_at_both_widths(
        browser: Any, consoles: Any, redis_url: str, tmp_path: Path) -> None:
    """``/jobs``'s filter, typed into its form as an operator would at 1400 and 390 px: by
    actor (any case) and by job id, on the waiting line and on the delayed one (a retry in
    its backoff); the filter is kept by the other kind's link and by a cancel's answer,
    which cancels only what was selected; every page fits the width."""
    client = redis.Redis.from_url(redis_url)
    console = consoles(CONSOLE_TOKEN=TOKEN)
    broker = Jobs(redis_url).broker
    for width in WIDTHS:
        client.flushall()
        reports = [Message(queue_name="reports", actor_name="build_report", args=(n,),
                           kwargs={}, options={}) for n in range(4)]
        invoice = Message(queue_name="reports", actor_name="send_invoice", args=(),
                          kwargs={"invoice_id": "inv-7"}, options={})
        retry = Message(queue_name="reports", actor_name="send_invoice", args=(),
                        kwargs={"invoice_id": "inv-8"}, options={"retries": 3})
        for message in (*reports[:2], invoice, *reports[2:]):
            broker.enqueue(message)
        broker.enqueue(retry, delay=600_000)
        context = screen(browser, width)
        page = context.new_page()

        def filtered(sought: str, p: Any = page, w: int = width) -> list[str]:
            """Type ``sought`` into the page's filter and press it: the rows' text."""
            p.fill("form.search input[name=find]", sought)
            p.click("form.search button")
            p.wait_for_load_state("load")
            fits(p, w, f"/jobs filtered by {sought!r}")
            return [row.inner_text() for row in p.locator("table tbody tr").all()]

        try:
            page.goto(f"{console.url}/jobs?queue=reports")
            assert page.locator("table tbody tr").count() == 5
            rows = filtered("SEND_INVOICE")
            assert len(rows) == 1 and "inv-7" in rows[0], rows
            assert page.locator("td[data-label='#']").inner_text() == "3", "its place in line"
            assert "5 waiting on reports; 1 of them match 'SEND_INVOICE'" in (
                page.inner_text("body"))
            rows = filtered(reports[2].message_id)
            assert len(rows) == 1 and reports[2].message_id in rows[0], rows
            rows = filtered("no-such-job")
            assert rows == [] and "Nothing waiting on reports matches 'no-such-job'" in (
                page.inner_text("body"))
            filtered("send_invoice")
            page.click("text=delayed")
            assert urllib.parse.parse_qs(urllib.parse.urlparse(page.url).query)["find"] == [
                "send_invoice"]
            rows = [row.inner_text() for row in page.locator("table tbody tr").all()]
            assert len(rows) == 1 and "retry 3" in rows[0] and "inv-8" in rows[0], rows
            page.screenshot(path=str(tmp_path / f"jobs-filtered-{width}.png"), full_page=True)

            page.goto(f"{console.url}/jobs?queue=reports&find=build_report")
            assert page.locator("table tbody tr").count() == 4
            page.check(f"input[name=id][value='{reports[1].message_id}']")
            assert sign_and_press(page, "cancel", TOKEN, "/jobs/act") == 200
            body = page.inner_text("body")
            assert "Cancelled 1 selected jobs (" in body
            assert "4 of them match 'build_report'" in body, "the answer keeps the filter"
            fits(page, width, "the answer to a filtered page's cancel")
            cancelled = {m.decode() for m in client.zrange("dramatiq:__cancelled__", 0, -1)}
            assert cancelled == {reports[1].message_id}, cancelled
        finally:
            context.close()
    actions = [r for r in console.records() if r.get("event") == "console_action"]
    assert [(r["action"], r["outcome"], r["queue"]) for r in actions] == [
        ("cancel", "cancelled", "reports")] * 2
