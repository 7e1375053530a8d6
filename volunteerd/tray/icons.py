"""The tray icon of each state, drawn with Pillow (no image files to ship).

Each state differs in colour *and* shape, so it reads at 16 px and without colour:

* contributing — a green disc with a white "play" triangle,
* waiting      — an amber disc with three white dots (running, contributing nothing:
  not in a project, no peers, unreachable, waiting for work),
* paused       — a grey disc with two white bars,
* error        — a red triangle with a white "!",
* disconnected — a hollow grey ring crossed by a slash.

Drawn at four times the size and scaled down, for smooth edges. The background is
transparent (pystray's plain-X backend shows it black, where the shapes still read).
"""

from __future__ import annotations

from PIL import Image, ImageDraw

from volunteerd.tray.menu import IconState

__all__ = ["COLOURS", "icon_image"]

COLOURS: dict[IconState, tuple[int, int, int]] = {
    "contributing": (46, 158, 68),
    "waiting": (214, 137, 16),
    "paused": (128, 128, 128),
    "error": (211, 47, 47),
    "disconnected": (158, 158, 158),
}
_WHITE = (255, 255, 255, 255)
_SCALE = 4


def icon_image(state: IconState, size: int = 64) -> Image.Image:
    """A square RGBA image, ``size`` pixels wide, for ``state``."""
    big = size * _SCALE
    image = Image.new("RGBA", (big, big), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    colour = (*COLOURS[state], 255)
    u = big / 64  # drawing unit: the shapes below are laid out on a 64-unit grid

    def box(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float, float, float]:
        return (x0 * u, y0 * u, x1 * u, y1 * u)

    if state == "contributing":
        draw.ellipse(box(2, 2, 62, 62), fill=colour)
        draw.polygon([(24 * u, 16 * u), (24 * u, 48 * u), (49 * u, 32 * u)], fill=_WHITE)
    elif state == "waiting":
        draw.ellipse(box(2, 2, 62, 62), fill=colour)
        for x in (18, 32, 46):
            draw.ellipse(box(x - 5, 27, x + 5, 37), fill=_WHITE)
    elif state == "paused":
        draw.ellipse(box(2, 2, 62, 62), fill=colour)
        draw.rounded_rectangle(box(20, 17, 28, 47), radius=2 * u, fill=_WHITE)
        draw.rounded_rectangle(box(36, 17, 44, 47), radius=2 * u, fill=_WHITE)
    elif state == "error":
        draw.polygon([(32 * u, 3 * u), (62 * u, 59 * u), (2 * u, 59 * u)], fill=colour)
        draw.rounded_rectangle(box(28.5, 20, 35.5, 42), radius=2 * u, fill=_WHITE)
        draw.ellipse(box(28.5, 46, 35.5, 53), fill=_WHITE)
    else:
        draw.ellipse(box(5, 5, 59, 59), outline=colour, width=round(8 * u))
        draw.line([(14 * u, 50 * u), (50 * u, 14 * u)], fill=colour, width=round(8 * u))
    return image.resize((size, size), Image.Resampling.LANCZOS)
