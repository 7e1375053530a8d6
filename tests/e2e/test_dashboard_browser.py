"""The dashboard in a real browser (Debian's headless Chromium) against a real daemon: it
shows what the daemon does as it happens, its buttons and form change the daemon, it
joins a published project and rides through the daemon's restart, its charts start
with the daemon's last minutes, it fits a 420 px wide screen, and it says so when it
has no key or the daemon is gone."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.e2e.conftest import Proc, publish, run_cli
from volunteerd.control.client import ControlClient
from volunteerd.errors import ControlError, ExitCode
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net.background import BackgroundNode
from volunteerd.testing import local_config
from volunteerd.testing.ports import fixed_port

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
HIDDEN = 32
SMALL = ["--set", f"experts.hidden_dim={HIDDEN}", "--set", 'runtime.device="cpu"']
WAIT_S = 20
JOIN_WAIT_S = 120  # a restart, finding the manifest, fetching the experts, on a busy machine
NARROW = 420
LOCAL = ["--set", 'network.listen_host="127.0.0.1"']
MANIFEST = """\
name = "page-demo"
description = "A tiny model joined from the dashboard"
owner_name = "The browser test"
homepage = "https://example.org/page-demo"
hidden_dim = 16
uid_prefix = "ffn"
grid = [2, 2]
replication = 1
seed = 3
lifetime_days = 1
"""


@pytest.fixture
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    yield from chromium(tmp_path_factory)


def chromium(
    tmp_path_factory: pytest.TempPathFactory, *, lang: str | None = None
) -> Iterator[webdriver.Chrome]:
    """Headless Chromium; its pages' Intl formats in the locale ``lang`` (e.g. "de"):
    headless Chromium on Linux keeps en-US whatever --lang, LANGUAGE or LANG say, so the
    DevTools protocol sets it."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (apt install chromium chromium-driver)")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    # Chromium puts its singleton socket in a folder of TMPDIR and leaves it there: one
    # more /tmp/org.chromium.Chromium.* per run, for good. A folder of the test's own.
    scratch = tmp_path_factory.mktemp("chromium")
    options.add_argument(f"--user-data-dir={scratch / 'profile'}")
    service = Service(executable_path=str(CHROMEDRIVER), env={**os.environ, "TMPDIR": str(scratch)})
    driver = webdriver.Chrome(service=service, options=options)
    try:
        if lang is not None:
            driver.execute_cdp_cmd("Emulation.setLocaleOverride", {"locale": lang})
        yield driver
    finally:
        driver.quit()


def waiting(driver: WebDriver) -> WebDriverWait[WebDriver]:
    # The page redraws its tables and lists: an element found may be replaced at once.
    return WebDriverWait(driver, WAIT_S, ignored_exceptions=[StaleElementReferenceException])


def value(driver: WebDriver, element_id: str) -> float | None:
    """The raw number behind a figure on the page (its ``data-value``)."""
    raw = driver.find_element(By.ID, element_id).get_attribute("data-value")
    return None if raw is None else float(raw)


def state(driver: WebDriver) -> str | None:
    return driver.find_element(By.ID, "state").get_attribute("data-state")


def text(driver: WebDriver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def activity(driver: WebDriver) -> str | None:
    return driver.find_element(By.ID, "state").get_attribute("data-activity")


def part_of(driver: WebDriver, item: str, part: str) -> WebElement:
    """The element ``part`` (a CSS selector) inside the list item ``item``, found anew."""
    return driver.find_element(By.CSS_SELECTOR, f"{item} {part}")


def clicked(element: WebElement) -> bool:
    element.click()
    return True


def click(driver: WebDriver, element_id: str) -> None:
    driver.find_element(By.ID, element_id).click()


def type_into(driver: WebDriver, element_id: str, typed: str) -> None:
    """Replace an input's value as a person would (focused throughout, so the page's live
    updates leave it alone)."""
    field = driver.find_element(By.ID, element_id)
    field.click()
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(typed)


def set_width(driver: WebDriver, width: int) -> None:
    """Lay the page out ``width`` CSS pixels wide (a phone's, or the window's again)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
    )


def fits(driver: WebDriver) -> bool:
    """Nothing sticks out sideways: the page does not scroll horizontally."""
    return bool(driver.execute_script("return document.documentElement.scrollWidth <= innerWidth"))


def save_screenshot(driver: WebDriver, tmp_path: Path, name: str, *, width: int = 0) -> None:
    """The window, or with ``width`` the whole page laid out that wide."""
    folder = Path(os.environ.get("VOLUNTEERD_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if width:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
    driver.save_screenshot(str(path))
    if width:
        set_width(driver, width)
    print(f"dashboard screenshot: {path}")


@contextmanager
def trainer_calling(multiaddrs: list[str], uids: list[str]) -> Iterator[None]:
    """A trainer in a thread that calls forward and backward on ``uids`` until the block
    ends."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with BackgroundNode(Identity.generate(), local_config(bootstrap=multiaddrs)) as node:
                experts = []
                for uid in uids:
                    deadline = time.monotonic() + WAIT_S
                    while not (peers := node.run(node.node.dht.find_expert, uid)):
                        assert time.monotonic() < deadline, f"{uid} not found"
                        time.sleep(0.2)
                    experts.append(RemoteExpert(uid, peers[0], node))
                while not stop.is_set():
                    for expert in experts:
                        expert(torch.randn(8, HIDDEN, requires_grad=True)).sum().backward()
                    stop.wait(0.02)
        except BaseException as exc:  # reported to the test's thread below
            errors.append(exc)

    thread = threading.Thread(target=run, name="trainer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
        if errors:  # (chained to the test's own failure, if it failed waiting for traffic)
            raise errors[0]


def test_dashboard_follows_the_daemon_live_and_its_controls_change_it(
    spawn: Callable[..., Proc], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    server = spawn(
        "server", "serve", "--experts", "ffn.0.[0:2]", *SMALL,
        "--set", "control.port=0", "--set", "stats.flush_s=0.5",
    )  # fmt: skip
    ready = server.wait_ready()
    client = ControlClient.for_data_dir(tmp_path / "server" / "data")
    assert ready["control_url"] == client.endpoint.url
    wait = waiting(browser)

    browser.get(client.dashboard_url)
    wait.until(lambda d: state(d) == "running")
    assert "token" not in browser.current_url, "the token leaves the address bar"
    assert text(browser, "peer-id").startswith(ready["peer_id"][:8])
    assert value(browser, "samples-today") == 0

    # A trainer calls the experts: the rates rise while it does, and the totals match the
    # API's once it stops.
    with trainer_calling(ready["multiaddrs"], ["ffn.0.0", "ffn.0.1"]):
        wait.until(lambda d: (value(d, "rate-samples") or 0) > 0)
        wait.until(lambda d: (value(d, "rate-upload") or 0) > 0)
    wait.until(lambda d: value(d, "samples-today") == client.status().today.samples)
    assert client.status().today.samples > 0
    assert value(browser, "requests-today") == client.status().today.requests
    # All the data sent and received, as the quota counts it (read from the throttle
    # once a second), and the expert calls' part of it below.
    assert (value(browser, "up-today") or 0) > 0
    assert (value(browser, "down-today") or 0) > 0
    wait.until(lambda d: (value(d, "sent-today") or 0) >= (value(d, "up-today") or 0))
    wait.until(lambda d: (value(d, "received-today") or 0) >= (value(d, "down-today") or 0))
    forward = '#experts-body tr[data-uid="ffn.0.0"] td:nth-child(2)'
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, forward).text not in ("", "0"))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#peers-body tr:not(.empty)"))
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-samples path.series")
    Select(browser.find_element(By.ID, "history-range")).select_by_value("604800")  # 7 days
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-history rect.bar"))

    # Pause and Resume change the daemon, and the page says so (the event too).
    state_events = '#events li[data-kind="state"]'
    before = len(browser.find_elements(By.CSS_SELECTOR, state_events))
    browser.find_element(By.ID, "pause").click()
    wait.until(lambda d: state(d) == "paused")
    assert client.status().state == "paused"
    # The state shows as soon as the page hears of it (the pause's answer, or the
    # status stream first); the buttons come back once the pause request is over.
    wait.until(lambda d: d.find_element(By.ID, "resume").is_enabled())
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, state_events)) > before)
    browser.find_element(By.ID, "resume").click()
    wait.until(lambda d: state(d) == "running")
    assert client.status().state == "running"

    # The limits form: a good value is saved, a bad one is refused next to its field.
    type_into(browser, "upload-mbit", "5")
    browser.find_element(By.ID, "save-limits").click()
    wait.until(lambda d: text(d, "limits-status") == "Saved.")
    assert client.limits().upload_mbit == 5
    type_into(browser, "upload-mbit", "-1")
    browser.find_element(By.ID, "save-limits").click()
    wait.until(lambda d: text(d, "upload-mbit-error"))
    with pytest.raises(ControlError) as refused:
        client.set_limits(upload_mbit=-1)
    assert text(browser, "upload-mbit-error") == str(refused.value)
    field = browser.find_element(By.ID, "upload-mbit")
    assert field.get_attribute("aria-invalid") == "true"
    assert client.limits().upload_mbit == 5
    wait.until(lambda d: "limit 5 Mbit/s" in text(d, "limit-upload-note"))

    # Events say what changed in words, not the settings' keys.
    limits_events = '#events li[data-kind="limits"] .message'
    wait.until(
        lambda d: (
            "upload limit set to 5 Mbit/s"
            in [e.text for e in d.find_elements(By.CSS_SELECTOR, limits_events)]
        )
    )

    save_screenshot(browser, tmp_path, "dashboard.png")

    # On a phone: the totals (real numbers now), tables and charts fit 420 px; the wide
    # tables scroll inside their cards, never the page.
    set_width(browser, NARROW)
    wait.until(lambda d: d.execute_script("return innerWidth") == NARROW)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-samples path.series"))
    assert fits(browser), browser.execute_script(
        "return [document.documentElement.scrollWidth, innerWidth]"
    )
    save_screenshot(browser, tmp_path, "dashboard-420.png", width=NARROW)
    # The refused save is logged by the browser as a failed request; nothing else may be.
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert [e for e in errors if e["source"] != "network"] == [], errors


def test_dashboard_asks_for_the_key_and_rides_out_a_daemon_restart(
    spawn: Callable[..., Proc], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    port = fixed_port()  # fixed, so the restarted daemon answers at the same address
    args = ("serve", "--experts", "ffn.0.0", *SMALL, "--set", f"control.port={port}")
    first = spawn("server", *args)
    first.wait_ready()
    client = ControlClient.for_data_dir(tmp_path / "server" / "data")
    wait = waiting(browser)

    def open_page(url: str) -> None:
        browser.get("about:blank")  # each time a new document, which reads the fragment
        browser.get(url)

    open_page(client.endpoint.url + "/")
    wait.until(lambda d: d.find_element(By.ID, "auth").is_displayed())
    assert "volunteerd dashboard" in text(browser, "auth")
    assert not browser.find_element(By.ID, "main").is_displayed()
    open_page(client.endpoint.url + "/#token=wrong")
    wait.until(lambda d: "did not accept" in text(d, "auth"))

    open_page(client.dashboard_url)
    wait.until(lambda d: state(d) == "running")
    first_started = client.status().started_at

    assert first.stop() == ExitCode.INTERRUPTED
    wait.until(lambda d: d.find_element(By.ID, "banner").is_displayed())
    assert "not reachable" in text(browser, "banner")
    assert state(browser) == "offline"
    assert not browser.find_element(By.ID, "pause").is_enabled()

    (tmp_path / "server" / "ready.json").unlink()
    spawn("server", *args).wait_ready()
    started = client.status().started_at
    assert started != first_started
    wait.until(lambda d: state(d) == "running")
    assert not browser.find_element(By.ID, "banner").is_displayed()

    def only_new_events(d: WebDriver) -> bool:
        shown = [
            t.get_attribute("datetime") for t in d.find_elements(By.CSS_SELECTOR, "#events time")
        ]
        times = [datetime.fromisoformat(t or "").timestamp() for t in shown]
        return bool(times) and min(times) > started - 1  # (the page's times are in ms)

    wait.until(only_new_events)  # the old daemon's events made way for the new one's


def test_charts_start_with_the_daemons_last_minutes(
    spawn: Callable[..., Proc], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """A page opened now draws the last minutes the daemon sampled, not "Collecting…"."""
    daemon = spawn("idle", "serve", "--set", "control.port=0")  # hosts nothing: no torch
    daemon.wait_ready()
    client = ControlClient.for_data_dir(tmp_path / "idle" / "data")
    deadline = time.monotonic() + 120
    while len(client.history().samples) < 10:  # ~20 s of samples, however busy the CPU
        assert time.monotonic() < deadline, client.history()
        time.sleep(1)
    sampled = client.history().samples
    opened_at = time.time()

    browser.get(client.dashboard_url)
    points = "#chart-samples"
    waiting(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{points} path.series"))
    chart = browser.find_element(By.CSS_SELECTOR, points)
    # Drawn from the daemon's samples: points from before the page existed, as many.
    assert float(chart.get_attribute("data-first-t") or "inf") < opened_at
    assert int(chart.get_attribute("data-points") or 0) >= len(sampled)
    assert float(chart.get_attribute("data-first-t") or 0) == sampled[0].t
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-bandwidth path.series")


def test_schedule_and_the_new_limits_round_trip_through_the_form(
    spawn: Callable[..., Proc], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    daemon = spawn("idle", "serve", "--set", "control.port=0")
    daemon.wait_ready()
    client = ControlClient.for_data_dir(tmp_path / "idle" / "data")
    wait = waiting(browser)
    browser.get(client.dashboard_url)
    wait.until(lambda d: d.find_element(By.ID, "schedule").is_displayed())
    wait.until(lambda d: d.find_element(By.ID, "idle-minutes").get_attribute("value") != "")

    Select(browser.find_element(By.ID, "schedule-run")).select_by_value("when_idle")
    type_into(browser, "idle-minutes", "5")
    type_into(browser, "compute-hours", "22:00-07:00, 12:00-13:30")
    Select(browser.find_element(By.ID, "schedule-gpu")).select_by_value("when_idle")
    type_into(browser, "daily-quota-gb", "2")
    type_into(browser, "cpu-threads", "1")
    # a decimal comma, in an English browser too (a number field read "2,5" as 25)
    type_into(browser, "upload-mbit", "2,5")
    click(browser, "save-limits")
    wait.until(lambda d: text(d, "limits-status") == "Saved.")
    assert client.limits().upload_mbit == 2.5
    schedule = client.schedule()
    assert schedule.run == "when_idle"
    assert schedule.idle_minutes == 5
    assert schedule.compute_hours == ["22:00-07:00", "12:00-13:30"]
    assert schedule.network_hours == []
    assert schedule.gpu == "when_idle"
    assert not schedule.on_battery
    limits = client.limits()
    assert (limits.daily_quota_gb, limits.cpu_threads) == (2, 1)

    # Both marks at once could be a thousands separator: refused, not guessed.
    type_into(browser, "upload-mbit", "1,234.5")
    click(browser, "save-limits")
    wait.until(lambda d: text(d, "upload-mbit-error"))
    assert "one decimal mark" in text(browser, "upload-mbit-error")
    assert client.limits().upload_mbit == 2.5
    type_into(browser, "upload-mbit", "2.5")

    # A bad window is refused next to its field, and nothing of it is applied.
    type_into(browser, "network-hours", "25:00-26:00")
    click(browser, "save-limits")
    wait.until(lambda d: text(d, "network-hours-error"))
    assert client.schedule().network_hours == []

    # A new page shows what the daemon keeps.
    browser.get("about:blank")
    browser.get(client.dashboard_url)
    wait.until(lambda d: d.find_element(By.ID, "compute-hours").get_attribute("value"))
    field = browser.find_element(By.ID, "compute-hours")
    assert field.get_attribute("value") == "22:00-07:00, 12:00-13:30"
    run = Select(browser.find_element(By.ID, "schedule-run")).first_selected_option
    assert run.get_attribute("value") == "when_idle"
    schedule_events = '#events li[data-kind="schedule"] .message'
    wait.until(
        lambda d: any(
            "only when the computer is idle" in e.text
            for e in d.find_elements(By.CSS_SELECTOR, schedule_events)
        )
    )


def test_joining_a_published_project_from_the_page_rides_through_the_restart(
    spawn: Callable[..., Proc], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    boot = spawn("boot", "bootstrap")
    address = boot.wait_ready()["multiaddrs"][0]
    owner_id = run_cli(tmp_path / "owner", "id").stdout.strip()
    manifest = tmp_path / "experiment.toml"
    manifest.write_text(MANIFEST)
    invitation = publish(tmp_path / "owner", manifest, address)

    port = fixed_port()  # fixed: the restarted daemon answers where the page asks
    volunteer = spawn(
        "volunteer", "serve", "--set", f"control.port={port}",
        "--set", 'runtime.device="cpu"', "--set", "experiments.max_experts=2",
    )  # fmt: skip
    volunteer.wait_ready()
    client = ControlClient.for_data_dir(tmp_path / "volunteer" / "data")
    first_started = client.status().started_at
    wait = waiting(browser)
    browser.get(client.dashboard_url + "&join")  # as the tray's "Join a project…" opens it
    wait.until(lambda d: activity(d) == "not_in_project")
    assert "join" in text(browser, "activity-hint")
    wait.until(lambda d: d.switch_to.active_element.get_attribute("id") == "invitation")

    # Not an invitation: refused next to the field, and the daemon records nothing.
    type_into(browser, "invitation", "volunteerd://join/page-demo?owner=nobody")
    click(browser, "check-invitation")
    wait.until(lambda d: text(d, "invitation-error"))
    assert not browser.find_element(By.ID, "join-preview").is_displayed()

    # The real one: first whose project it is, with nothing recorded yet.
    type_into(browser, "invitation", invitation)
    click(browser, "check-invitation")
    wait.until(lambda d: d.find_element(By.ID, "join-preview").is_displayed())
    assert text(browser, "preview-name") == "page-demo"
    owner = browser.find_element(By.ID, "preview-owner")
    assert owner.get_attribute("title") == owner_id
    assert owner.text == f"{owner_id[:8]}…{owner_id[-6:]}"
    assert address in text(browser, "preview-peers")
    assert client.status().projects == []
    set_width(browser, NARROW)  # a long peer address must not widen the page
    wait.until(lambda d: d.execute_script("return innerWidth") == NARROW)
    assert fits(browser)
    save_screenshot(browser, tmp_path, "dashboard-join-420.png", width=NARROW)
    set_width(browser, 1280)

    # Confirmed: the daemon records it and restarts (same process, execv); the page says
    # so, waits for the new daemon and then shows whose project this machine helps.
    click(browser, "confirm-join")
    joined = '#projects li[data-name="page-demo"]'
    waiting_long = WebDriverWait(
        browser, JOIN_WAIT_S, ignored_exceptions=[StaleElementReferenceException]
    )
    waiting_long.until(lambda d: text(d, "join-status") == "Now helping page-demo.")
    assert client.status().started_at != first_started
    assert volunteer.process.poll() is None, "restarted in place"
    waiting_long.until(
        lambda d: d.find_element(By.CSS_SELECTOR, joined).get_attribute("data-state") == "joined"
    )
    waiting_long.until(lambda d: client.status().experts)
    # The list is drawn again whenever a project's figures change (its experts arrive),
    # so each look at the item finds it afresh (waiting_long ignores stale elements).
    helping = "Helping: A tiny model joined from the dashboard by The browser test"
    waiting_long.until(lambda d: part_of(d, joined, ".project-title").text == helping)
    waiting_long.until(
        lambda d: (
            part_of(d, joined, "a.project-home").get_attribute("href")
            == "https://example.org/page-demo"
        )
    )
    home_rel = waiting_long.until(
        lambda d: part_of(d, joined, "a.project-home").get_attribute("rel") or "-"
    )
    assert "noopener" in home_rel
    assert not browser.find_element(By.ID, "banner").is_displayed()
    set_width(browser, NARROW)
    wait.until(lambda d: d.execute_script("return innerWidth") == NARROW)
    assert fits(browser)
    save_screenshot(browser, tmp_path, "dashboard-project-420.png", width=NARROW)
    set_width(browser, 1280)

    # Leave: asked once more, then the daemon restarts into hosting nothing.
    waiting_long.until(lambda d: clicked(part_of(d, joined, ".leave")))
    waiting_long.until(
        lambda d: clicked(d.find_element(By.CSS_SELECTOR, '[data-testid="confirm-leave"]'))
    )
    waiting_long.until(lambda d: text(d, "join-status") == "Left page-demo.")
    waiting_long.until(lambda d: activity(d) == "not_in_project")
    assert client.status().projects == []
    assert not browser.find_elements(By.CSS_SELECTOR, joined)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    # the refused invitation and the restarts show as failed requests; nothing else may
    assert [e for e in errors if e["source"] != "network"] == [], errors


def test_a_project_entry_this_release_refuses_is_shown_and_left_from_the_page(
    spawn: Callable[..., Proc], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """An older release's projects.toml named a project only through a peer this release
    refuses (a /dnsaddr/ address): the daemon sets it aside. The page listed nothing of
    it (only an error event said so); it now shows it as not hosted, with what to do,
    and its Leave button removes it from the file without a restart."""
    data = tmp_path / "volunteer" / "data"
    data.mkdir(parents=True)
    owner = run_cli(tmp_path / "owner", "id").stdout.strip()
    (data / "projects.toml").write_text(
        f'[[project]]\nname = "old-demo"\nowner = "{owner}"\n'
        f'peers = ["/dnsaddr/boot.example.org/p2p/{owner}"]\n'
    )
    volunteer = spawn("volunteer", "serve", *SMALL)
    volunteer.wait_ready()
    client = ControlClient.for_data_dir(data)
    started = client.status().started_at
    wait = waiting(browser)
    browser.get(client.dashboard_url)
    item = '#projects li[data-name="old-demo"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, item))
    assert browser.find_element(By.CSS_SELECTOR, item).get_attribute("data-state") == "not_hosted"
    assert part_of(browser, item, ".project-title").text == "Not hosted: old-demo"
    assert part_of(browser, item, ".badge").text == "not hosted"
    assert "none of its peers" in part_of(browser, item, ".project-error").text
    assert "volunteerd leave old-demo" in part_of(browser, item, ".project-advice").text
    assert activity(browser) == "not_in_project"  # listed, not joining

    wait.until(lambda d: clicked(part_of(d, item, ".leave")))
    wait.until(lambda d: clicked(d.find_element(By.CSS_SELECTOR, '[data-testid="confirm-leave"]')))
    wait.until(lambda d: text(d, "join-status") == "Left old-demo.")
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, item))
    assert client.status().projects == []
    assert client.status().started_at == started  # no restart
    assert "old-demo" not in (data / "projects.toml").read_text()


@contextmanager
def static_files() -> Iterator[str]:
    """The dashboard's static folder served on 127.0.0.1 (no daemon): its address."""
    folder = Path(__file__).resolve().parents[2] / "volunteerd" / "dashboard" / "static"
    handler = partial(SimpleHTTPRequestHandler, directory=str(folder))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_success_whose_body_cannot_be_read_counts_as_no_answer(browser: WebDriver) -> None:
    # A 200 whose body was cut off became ``null`` and renderStatus(null) threw a
    # TypeError (an outside audit, under 500 concurrent requests); it is "unreachable".
    with static_files() as base:
        browser.get(base + "/index.html")
        outcome = browser.execute_async_script(
            """
            const done = arguments[arguments.length - 1];
            const api = await import("/api.js");
            const told = [];
            const on = { answered: () => told.push("answered"), lost: () => told.push("lost"),
                         refused: () => told.push("refused") };
            const replies = [new Response('{"started_at": 1', { status: 200 }),
                             new Response("<html>", { status: 500 }),
                             new Response('{"started_at": 1}', { status: 200 })];
            window.fetch = async () => replies.shift();
            const call = api.connect("token", on);
            const seen = [];
            for (let i = 0; i < 3; i++) {
              try {
                seen.push(JSON.stringify(await call("GET", "/status")));
              } catch (err) {
                seen.push(err.constructor.name);
              }
            }
            done({ seen, told });
            """
        )
    assert outcome["seen"] == ["Unreachable", "ApiError", '{"started_at":1}']
    assert outcome["told"] == ["lost", "answered", "answered"]


# What format.js makes of numbers in the browser's language: (typed or shown, expected).
LOCALE_NUMBERS = {
    "en-US": {"rate": "12.5", "bytes": "1.25 MB", "duration": "8.5 s", "input": "2.5"},
    "de": {"rate": "12,5", "bytes": "1,25 MB", "duration": "8,5 s", "input": "2,5"},
    # the page in Arabic digits, the fields in Latin ones (parseDecimal reads both)
    "ar-EG": {
        "rate": "\u0661\u0662\u066b\u0665",  # 12.5 in Arabic digits and decimal mark
        "bytes": "\u0661\u066b\u0662\u0665 MB",
        "duration": "\u0668\u066b\u0665 s",
        "input": "2.5",
    },
}
# what a daemon may hold: each must come back from its field unchanged, or Save fails
# on a field nobody touched (2.5 in Arabic digits was "not a number"; "1.125" reads
# two ways)
HELD = [0, 2.5, 1.125, 999.999, 100, 1500, 0.001, -1]
# typed in any browser language: read as
TYPED = {
    "2,5": 2.5,
    "2.5": 2.5,
    " 2,5 ": 2.5,
    ",5": 0.5,
    "0": 0,
    "\u0661\u066b\u0665": 1.5,  # Arabic digits and decimal mark
    "\u06f2\u066b\u06f5": 2.5,  # Persian
    "\u0968.\u096b": 2.5,  # Devanagari
    "\u200e-1": -1,  # as Intl writes -1 in Arabic
    "\u22121": -1,  # and in Swedish
    "1e3": 1000,
    "2,5e-1": 0.25,
    "1,0": 1,
    "0,125": 0.125,
    "1234,567": 1234.567,
    "1,2500": 1.25,
}


@pytest.mark.parametrize("lang", sorted(LOCALE_NUMBERS))
def test_numbers_are_read_and_shown_in_the_browsers_language(
    tmp_path_factory: pytest.TempPathFactory, lang: str
) -> None:
    # A German page showed "12.5" and "1.25 MB" beside "1.234" (Intl), a number field
    # in an English browser read "2,5" as 25, an Arabic one showed 2.5 in Arabic digits
    # and refused them, and "1,000" (GB) was read as 1.
    with static_files() as base:
        for driver in chromium(tmp_path_factory, lang=lang):
            driver.get(base + "/index.html")
            seen = driver.execute_async_script(
                """
                const [typed, held, done] = arguments;
                const f = await import("/format.js");
                done({
                  rate: f.fmtRate(12.5), bytes: f.fmtBytes(1.25e6), duration: f.fmtDuration(8.5),
                  input: f.fmtInput(2.5),
                  read: typed.map((t) => f.parseDecimal(t).value),
                  empty: f.parseDecimal("").value,
                  refused: ["1,234.5", "1.234,5", "2 5", "abc", "1e999"].map(
                    (t) => f.parseDecimal(t).error ?? null),
                  twoWays: ["1,000", "1.000", "10,000", "2,500"].map(
                    (t) => f.parseDecimal(t).error ?? null),
                  held: held.map((v) => f.parseDecimal(f.fmtInput(v)).value),
                  typeOfUpload: document.getElementById("upload-mbit").type,
                });
                """,
                list(TYPED),
                HELD,
            )
    assert {k: seen[k] for k in LOCALE_NUMBERS[lang]} == LOCALE_NUMBERS[lang]
    assert dict(zip(TYPED, seen["read"], strict=True)) == TYPED
    assert seen["empty"] is None
    assert all(seen["refused"]), seen["refused"]
    assert seen["twoWays"] == [
        '1,000 reads two ways: write 1000, or 1,0 if "," is the decimal mark',
        '1.000 reads two ways: write 1000, or 1.0 if "." is the decimal mark',
        '10,000 reads two ways: write 10000, or 10,0 if "," is the decimal mark',
        '2,500 reads two ways: write 2500, or 2,5 if "," is the decimal mark',
    ]
    assert seen["held"] == HELD
    assert seen["typeOfUpload"] == "text"
