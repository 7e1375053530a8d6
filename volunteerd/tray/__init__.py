"""The tray app (``volunteerd tray``): its own process, a client of the control API only.

* ``menu``  — the menu as data: what the icon and the menu show for what the tray
  knows about the daemon, and which client call each item makes. Pure, no display.
* ``icons`` — the icon of each state, drawn with Pillow.
* ``app``   — the pystray app: polls the daemon, renders ``menu``, runs the actions in a
  worker thread, starts the daemon if none runs.

This package imports nothing that needs a display; ``app`` imports pystray when it runs.
"""

from __future__ import annotations
