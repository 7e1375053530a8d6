"""Regenerate the dashboard's pictures in docs/images/.

dashboard.png — a daemon at work
    Starts a real local swarm (a bootstrap node and ``--nodes`` daemons, every expert of
    the demo's model hosted twice), trains the demo's language model on it from this
    process, and opens the first daemon's dashboard in headless Chromium. While training
    runs for ``--seconds`` it sets some limits and pauses that daemon for a while (the
    trainer falls back to the other copy of each expert), so the charts, totals, experts,
    peers and events all have something to show. Then it saves the page at 1280 pixels
    wide, all of it (``--viewport-only``: the first 1280x900 only).

dashboard-join.png, dashboard-project.png, dashboard-schedule.png — joining a project
    An owner publishes an experiment through a bootstrap node (``volunteerd publish``,
    which prints the invitation); a fresh daemon, in a throw-away home, hosts nothing.
    On its page the invitation is pasted and checked (``-join``: whose project it is),
    then joined: the daemon restarts into it and the page shows whom it helps
    (``-project``). Last, the schedule is set to compute only when the computer is idle
    and outside office hours, and the limits and schedule card is saved alone
    (``-schedule``).

Needs Debian's ``chromium`` and ``chromium-driver`` packages and ``selenium``.

Run::

    .venv/bin/python scripts/screenshot_dashboard.py              # about five minutes
    .venv/bin/python scripts/screenshot_dashboard.py --seconds 60 --out /tmp/dash.png
    .venv/bin/python scripts/screenshot_dashboard.py --only join  # about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from volunteerd.control.client import ControlClient
from volunteerd.demo.local_swarm import LocalSwarm
from volunteerd.demo.run import run_training, trainer_config
from volunteerd.logs import configure_logging
from volunteerd.moe import SwarmClient
from volunteerd.train import Experiment

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1280, 900
# Checkpoints and replica averaging often enough to show up within a few minutes.
SETTINGS = ["checkpoints.every_s=20", "replicas.average_every_s=30"]
# The experiment of the joining pictures, as its owner would describe it.
MANIFEST = """\
name = "stdlib-chars"
description = "A character-level model of Python's standard library"
homepage = "https://example.org/stdlib-chars"
owner_name = "Ada's lab"
hidden_dim = 64
uid_prefix = "ffn"
grid = [4, 4]
replication = 1
seed = 3
lifetime_days = 30
"""
JOIN_WAIT_S = 180.0


def open_browser() -> WebDriver:
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(
        service=Service(executable_path="/usr/bin/chromedriver"), options=options
    )
    # The page itself 1280x900, whatever the window's frame takes.
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
    )
    return driver


def save(driver: WebDriver, out: Path, *, full_page: bool) -> None:
    if full_page:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {
                "width": WIDTH,
                "height": max(HEIGHT, height),
                "deviceScaleFactor": 1,
                "mobile": False,
            },
        )
        time.sleep(1)  # the charts redraw for the new size
    driver.execute_script("document.activeElement?.blur(); window.scrollTo(0, 0)")
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=240, help="how long to train first")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "images" / "dashboard.png",
        help="the daemon at work; the joining pictures go beside it (dashboard-join.png ...)",
    )
    parser.add_argument("--viewport-only", action="store_true", help="only the first 1280x900")
    parser.add_argument("--only", choices=("work", "join"), help="only these pictures")
    args = parser.parse_args()
    configure_logging("WARNING")
    if args.only != "work":
        shoot_joining(args.out.parent)
    if args.only != "join":
        shoot_at_work(args)
    return 0


def shoot_at_work(args: argparse.Namespace) -> None:

    experiment = Experiment()
    stop = threading.Event()
    with (
        LocalSwarm.for_experiment(
            experiment, args.nodes, replication=2, settings=SETTINGS
        ) as swarm,
        SwarmClient(trainer_config(swarm.bootstrap_addrs, listen_host="127.0.0.1")) as trainer,
    ):
        daemon = ControlClient.for_data_dir(swarm.daemons[0].ready_file.parent / "data")
        driver = open_browser()
        training: threading.Thread | None = None
        try:
            driver.get(daemon.dashboard_url)  # now, so the live charts fill as training runs
            WebDriverWait(driver, 30).until(
                lambda d: (
                    d.execute_script("return document.getElementById('state').dataset.state")
                    == "running"
                )
            )
            training = threading.Thread(
                target=run_training,
                args=(experiment,),
                kwargs={"client": trainer, "steps": 1_000_000, "out": io.StringIO(), "stop": stop},
                daemon=True,
            )
            training.start()
            started = time.monotonic()

            def at(share: float) -> None:
                time.sleep(max(0.0, started + share * args.seconds - time.monotonic()))

            at(0.35)
            daemon.set_limits(upload_mbit=20, download_mbit=50, monthly_quota_gb=100)
            at(0.5)
            daemon.pause()  # the trainer turns to the other copies of these experts
            at(0.6)
            daemon.resume()
            at(1.0)
            save(driver, args.out, full_page=not args.viewport_only)
            print(f"saved {args.out} ({daemon.status().today.samples:,} samples served today)")
        finally:
            stop.set()  # training ends after the step under way
            if training is not None:
                training.join(60)
            driver.quit()


# -- joining a project -------------------------------------------------------------------


def shoot_joining(folder: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="volunteerd-screens-") as tmp:
        homes = Path(tmp)
        with started(homes / "boot", "bootstrap") as boot:
            address = boot["multiaddrs"][0]
            manifest = homes / "experiment.toml"
            manifest.write_text(MANIFEST)
            published = cli(
                homes / "owner", "publish", str(manifest), "--bootstrap", address,
                "--set", 'network.listen_host="127.0.0.1"',
            )  # fmt: skip
            invitation = next(
                line for line in published.splitlines() if line.startswith("volunteerd://join/")
            )
            port = _free_port()  # fixed, so the page finds the daemon after its restart
            fresh = ["--set", f"control.port={port}", "--set", "experiments.max_experts=2"]
            with started(homes / "volunteer", "serve", *fresh):
                daemon = ControlClient.for_data_dir(homes / "volunteer" / "data")
                driver = open_browser()
                try:
                    _join_on_the_page(driver, daemon, invitation, folder)
                finally:
                    driver.quit()


def _join_on_the_page(
    driver: WebDriver, daemon: ControlClient, invitation: str, folder: Path
) -> None:
    def page(script: str) -> Any:
        return driver.execute_script(f"return {script}")

    wait = WebDriverWait(driver, JOIN_WAIT_S)
    driver.get(daemon.dashboard_url + "&join")
    wait.until(lambda d: page("document.getElementById('state').dataset.activity"))
    driver.find_element(By.ID, "invitation").send_keys(invitation)
    driver.find_element(By.ID, "check-invitation").click()
    wait.until(lambda d: d.find_element(By.ID, "join-preview").is_displayed())
    save(driver, folder / "dashboard-join.png", full_page=False)
    print(f"saved {folder / 'dashboard-join.png'}")

    driver.find_element(By.ID, "confirm-join").click()
    wait.until(lambda d: d.find_element(By.ID, "join-status").text.startswith("Now helping"))
    joined = "document.querySelector('#projects li[data-state=\"joined\"]')"
    wait.until(lambda d: page(joined) is not None)
    wait.until(lambda d: daemon.status().experts)
    time.sleep(6)  # a few points in the charts, the experts' table filled
    save(driver, folder / "dashboard-project.png", full_page=False)
    print(f"saved {folder / 'dashboard-project.png'}")

    daemon.set_schedule(run="when_idle", idle_minutes=5, compute_hours=["18:00-08:00"])
    daemon.set_limits(upload_mbit=10, daily_quota_gb=5)
    driver.get("about:blank")
    driver.get(daemon.dashboard_url)
    wait.until(lambda d: d.find_element(By.ID, "compute-hours").get_attribute("value"))
    time.sleep(2)  # the schedule's state line
    # the whole page in the window, so that the card (taller than 900 px) fits in it
    height = page("document.documentElement.scrollHeight")
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    time.sleep(1)
    card = driver.find_element(By.CSS_SELECTOR, "section.limits")
    driver.execute_script("document.activeElement?.blur()")
    card.screenshot(str(folder / "dashboard-schedule.png"))
    print(f"saved {folder / 'dashboard-schedule.png'}")


def cli(home: Path, *args: str) -> str:
    """``volunteerd <args>`` with its files under ``home``; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "volunteerd", *args],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"volunteerd {args[0]} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


@contextlib.contextmanager
def started(home: Path, *args: str) -> Iterator[dict[str, Any]]:
    """``volunteerd <args>`` running with its files under ``home``; yields what it wrote
    to its ready file; stopped (SIGTERM) on the way out."""
    home.mkdir(parents=True, exist_ok=True)
    ready = home / "ready.json"
    local = ["--listen-host", "127.0.0.1", "--port", "0", "--ready-file", str(ready)]
    with (home / "log.txt").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "volunteerd", *args, *local],
            env=_env(home),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"volunteerd {args[0]}: {(home / 'log.txt').read_text()}")
            time.sleep(0.1)
        yield json.loads(ready.read_text())
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOLUNTEERD_")}
    env.update(
        VOLUNTEERD_CONFIG=str(home / "config.toml"),
        VOLUNTEERD_DATA_DIR=str(home / "data"),
        VOLUNTEERD_CACHE_DIR=str(home / "cache"),
        VOLUNTEERD_CONTROL__PORT="0",
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    raise SystemExit(main())
