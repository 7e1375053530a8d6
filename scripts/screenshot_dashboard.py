"""Regenerate docs/images/dashboard.png: the dashboard of a daemon at work.

What it does
    Starts a real local swarm (a bootstrap node and ``--nodes`` daemons, every expert of
    the demo's model hosted twice), trains the demo's language model on it from this
    process, and opens the first daemon's dashboard in headless Chromium. While training
    runs for ``--seconds`` it sets some limits and pauses that daemon for a while (the
    trainer falls back to the other copy of each expert), so the charts, totals, experts,
    peers and events all have something to show. Then it saves the page at 1280 pixels
    wide, all of it (``--viewport-only``: the first 1280x900 only).

Needs Debian's ``chromium`` and ``chromium-driver`` packages and ``selenium``.

Run::

    .venv/bin/python scripts/screenshot_dashboard.py              # about four minutes
    .venv/bin/python scripts/screenshot_dashboard.py --seconds 60 --out /tmp/dash.png
"""

from __future__ import annotations

import argparse
import io
import threading
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
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
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "dashboard.png")
    parser.add_argument("--viewport-only", action="store_true", help="only the first 1280x900")
    args = parser.parse_args()
    configure_logging("WARNING")

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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
