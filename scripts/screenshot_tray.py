"""Regenerate the tray's pictures in docs/images/.

* ``tray-icons.png``: the five icons of ``volunteerd.tray.icons`` side by side, at 64
  and at 16 pixels, with their state names. Pillow only.
* ``tray-menu.png``: the real tray menu as GTK draws it (pystray's GTK backend, the
  one desktops without AppIndicator get), with the Bandwidth submenu open, docked in
  a real XEmbed system tray (trayer) on a private Xvfb display. The menu is
  ``volunteerd.tray.menu`` for a made-up status (helping a project, 1,234 samples
  today, upload limited to 5 Mbit/s, computing always); nothing talks to a daemon.
  The script right-clicks the icon and walks into the submenu with the keyboard
  (xdotool), as a person would.

Needs Xvfb, trayer, xdotool, dbus-daemon and PyGObject with GTK 3; on Debian or Ubuntu::

    apt-get install xvfb trayer xdotool dbus-daemon python3-gi gir1.2-gtk-3.0

PyGObject comes from the system's Python (``/usr/lib/python3/dist-packages``) when the
virtual environment has none; it must be the same Python version.

Usage: ``.venv/bin/python scripts/screenshot_tray.py [--out docs/images]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from volunteerd.control.models import Status  # noqa: E402
from volunteerd.tray import menu  # noqa: E402
from volunteerd.tray.app import pystray_items  # noqa: E402
from volunteerd.tray.icons import icon_image  # noqa: E402

SYSTEM_SITE = "/usr/lib/python3/dist-packages"
TRAYER_ARGS = ["--edge", "top", "--align", "left", "--widthtype", "request", "--height", "24"]
TRAYER_ARGS += ["--transparent", "false", "--SetDockType", "true"]
BACKDROP = (222, 226, 230)
MARGIN = 16
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"

T = TypeVar("T")

EXAMPLE = menu.Seen(
    "connected",
    status=Status.model_validate(
        {
            "version": "0.1.0",
            "peer_id": "12D3KooWExample",
            "activity": {"state": "contributing", "message": "contributing"},
            "projects": [
                {
                    "name": "stdlib-chars",
                    "owner": "12D3KooWOwnerExample",
                    "owner_name": "Ada's lab",
                    "description": "a model of Python's standard library",
                    "homepage": "https://example.org/stdlib-chars",
                    "share": 1.0,
                    "state": "joined",
                    "experts": 2,
                }
            ],
            "state": "running",
            "serving": True,
            "reason": "",
            "device": "cuda:0",
            "experts": ["ffn.0.3", "ffn.2.1"],
            "reachability": {"mode": "direct"},
            "limits": {
                "upload_mbit": 5.0,
                "download_mbit": 0.0,
                "monthly_quota_gb": 0.0,
                "duty_cycle": 1.0,
                "max_batch_size": 0,
            },
            "started_at": 0.0,
            "uptime_s": 3600.0,
            "connected_peers": 12,
            "rates": {},
            "today": {"samples": 1234},
        }
    ),
    schedule_run="always",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    draw_icons(args.out / "tray-icons.png")
    print(f"wrote {args.out / 'tray-icons.png'}")
    tools = ("Xvfb", "trayer", "xdotool", "dbus-daemon")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        print(f"cannot draw the menu: {', '.join(missing)} not installed", file=sys.stderr)
        return 1
    with desktop() as display:
        shoot_menu(display, args.out / "tray-menu.png")
    print(f"wrote {args.out / 'tray-menu.png'}")
    return 0


# -- the icons -----------------------------------------------------------------------------


def draw_icons(path: Path) -> None:
    cell, top = 120, 12
    font = ImageFont.truetype(FONT, 14) if Path(FONT).exists() else ImageFont.load_default()
    image = Image.new("RGBA", (cell * len(menu.ICON_STATES), 130), (*BACKDROP, 255))
    draw = ImageDraw.Draw(image)
    for i, state in enumerate(menu.ICON_STATES):
        x = i * cell
        image.alpha_composite(icon_image(state, 64), (x + (cell - 64) // 2, top))
        image.alpha_composite(icon_image(state, 16), (x + (cell - 16) // 2, top + 72))
        width = draw.textlength(state, font=font)
        draw.text((x + (cell - width) / 2, top + 96), state, fill=(40, 40, 40), font=font)
    image.convert("RGB").save(path, optimize=True)


# -- the menu ------------------------------------------------------------------------------


@contextlib.contextmanager
def desktop() -> Iterator[str]:
    """A private Xvfb display with trayer as its system tray, and a private session
    bus; yields the display name."""
    read_fd, write_fd = os.pipe()
    xvfb = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
        pass_fds=(write_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_fd)
    procs = [xvfb]
    try:
        with os.fdopen(read_fd) as f:
            display = ":" + f.readline().strip()
        procs.append(
            subprocess.Popen(
                ["trayer", *TRAYER_ARGS],
                env={**os.environ, "DISPLAY": display},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        # pystray's GTK backend wants a session bus (for notifications)
        bus = subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", "--print-address=1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(bus)
        assert bus.stdout is not None
        os.environ["DBUS_SESSION_BUS_ADDRESS"] = bus.stdout.readline().strip()
        yield display
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)


def shoot_menu(display: str, path: Path) -> None:
    os.environ["DISPLAY"] = display
    os.environ["PYSTRAY_BACKEND"] = "gtk"
    try:
        import gi
    except ImportError:
        sys.path.append(SYSTEM_SITE)  # the system's PyGObject (python3-gi)
        import gi
    gi.require_version("Gtk", "3.0")
    import pystray

    shown = menu.view(EXAMPLE)
    icon = pystray.Icon(
        "volunteerd",
        icon_image(shown.state),
        shown.title,
        menu=pystray.Menu(*pystray_items(pystray, shown.items, lambda action: None)),
    )
    errors: list[BaseException] = []
    started = time.time()

    def setup(icon: Any) -> None:
        try:
            icon.visible = True
            x, y, panel = wait_for("the icon docked in the tray", lambda: docked_icon(display))
            xdotool(display, "mousemove", str(x), str(y), "click", "3")
            wait_for("the menu", lambda: len(popups(display)) == 1 or None)
            # Pause, Snooze, Compute only when idle, Bandwidth; into it (Unlimited); 5 Mbit/s
            keys = ["Down"] * 4 + ["Right"]
            xdotool(display, "key", "--delay", "150", *keys)
            wait_for("the submenu", lambda: len(popups(display)) == 2 or None)
            xdotool(display, "key", "--delay", "150", "Down", "Down")
            xdotool(display, "mousemove", "1000", "760")  # no hover highlight
            time.sleep(1.0)  # let GTK draw (no event tells when it has)
            compose(grab(display), [panel, *popups(display)]).save(path, optimize=True)
        except BaseException as exc:
            errors.append(exc)
        finally:
            threading.Thread(target=icon.stop, daemon=True).start()

    try:
        icon.run(setup)
    except Exception as exc:
        # pystray's GTK backend hides its notification on the way out, and fails
        # where no notification service runs (as here): that comes after the picture.
        if not path.exists() or path.stat().st_mtime < started:
            raise
        print(f"(pystray on its way out: {exc})", file=sys.stderr)
    if errors:
        raise errors[0]


Box = tuple[int, int, int, int]  # x, y, width, height on the screen


def docked_icon(display: str) -> tuple[int, int, Box] | None:
    """The middle of the icon embedded in trayer's panel, and the panel's box."""
    from Xlib import X
    from Xlib import display as xdisplay

    d = xdisplay.Display(display)
    try:
        root = d.screen().root
        for top in root.query_tree().children:
            if top.get_wm_class() != ("panel", "trayer"):
                continue
            for socket in top.query_tree().children:
                for plug in socket.query_tree().children:
                    if plug.get_attributes().map_state != X.IsViewable:
                        continue
                    geometry = plug.get_geometry()
                    at = plug.translate_coords(root, 0, 0)
                    x, y = -at.x, -at.y
                    if geometry.width < 8:
                        continue
                    panel = top.get_geometry()
                    box = (panel.x, panel.y, panel.width, panel.height)
                    return x + geometry.width // 2, y + geometry.height // 2, box
        return None
    finally:
        d.close()


def popups(display: str) -> list[Box]:
    """The boxes of the mapped override-redirect windows: GTK's menus."""
    from Xlib import X
    from Xlib import display as xdisplay

    d = xdisplay.Display(display)
    try:
        boxes = []
        for window in d.screen().root.query_tree().children:
            attributes = window.get_attributes()
            if attributes.map_state != X.IsViewable or not attributes.override_redirect:
                continue
            g = window.get_geometry()
            if g.width > 40 and g.height > 40:
                boxes.append((g.x, g.y, g.width, g.height))
        return boxes
    finally:
        d.close()


def grab(display: str) -> Image.Image:
    from Xlib import X
    from Xlib import display as xdisplay

    d = xdisplay.Display(display)
    try:
        root = d.screen().root
        g = root.get_geometry()
        raw = root.get_image(0, 0, g.width, g.height, X.ZPixmap, 0xFFFFFFFF)
        return Image.frombytes("RGB", (g.width, g.height), raw.data, "raw", "BGRX")
    finally:
        d.close()


def compose(screen: Image.Image, boxes: list[Box]) -> Image.Image:
    """The windows in ``boxes`` cut from ``screen`` onto a plain backdrop."""
    left = min(x for x, _, _, _ in boxes) - MARGIN
    top = min(y for _, y, _, _ in boxes) - MARGIN
    right = max(x + w for x, _, w, _ in boxes) + MARGIN
    bottom = max(y + h for _, y, _, h in boxes) + MARGIN
    left, top = max(left, 0), max(top, 0)
    out = Image.new("RGB", (right - left, bottom - top), BACKDROP)
    for x, y, w, h in boxes:
        out.paste(screen.crop((x, y, x + w, y + h)), (x - left, y - top))
    return out


def xdotool(display: str, *args: str) -> None:
    subprocess.run(
        ["xdotool", *args], env={**os.environ, "DISPLAY": display}, check=True, timeout=20
    )


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 20) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not within {timeout_s}s")


if __name__ == "__main__":
    raise SystemExit(main())
