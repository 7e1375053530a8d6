"""The dashboard in a real browser (Debian's headless Chromium) against a real daemon: it
shows what the daemon does as it happens, its buttons and form change the daemon, and it
says so when it has no key or the daemon is gone."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
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
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.e2e.conftest import Proc
from volunteerd.control.client import ControlClient
from volunteerd.errors import ControlError, ExitCode
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net.background import BackgroundNode
from volunteerd.testing import local_config

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
HIDDEN = 32
SMALL = ["--set", f"experts.hidden_dim={HIDDEN}", "--set", 'runtime.device="cpu"']
WAIT_S = 20


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (apt install chromium chromium-driver)")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
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


def type_into(driver: WebDriver, element_id: str, typed: str) -> None:
    """Replace an input's value as a person would (focused throughout, so the page's live
    updates leave it alone)."""
    field = driver.find_element(By.ID, element_id)
    field.click()
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(typed)


def save_screenshot(driver: WebDriver, tmp_path: Path, name: str) -> None:
    folder = Path(os.environ.get("VOLUNTEERD_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    driver.save_screenshot(str(path))
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    assert browser.find_element(By.ID, "resume").is_enabled()
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

    save_screenshot(browser, tmp_path, "dashboard.png")
    # The refused save is logged by the browser as a failed request; nothing else may be.
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert [e for e in errors if e["source"] != "network"] == [], errors


def test_dashboard_asks_for_the_key_and_rides_out_a_daemon_restart(
    spawn: Callable[..., Proc], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    port = free_port()  # fixed, so the restarted daemon answers at the same address
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
