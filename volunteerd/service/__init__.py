"""Starting volunteerd with the user's session: ``volunteerd service ...``.

* ``files``    — the autostart files of each platform (systemd user unit and XDG
  autostart entry, LaunchAgents, Task Scheduler tasks), rendered from one ``Launch``;
  pure. ``packaging/`` holds them as ``volunteerd service render`` writes them.
* ``managers`` — systemd, launchd and Task Scheduler, driven through their tools.
* ``process``  — the daemon seen from outside: start it detached, wait until its
  control API answers, stop it.
* ``commands`` — the verbs: ``install``, ``uninstall``, ``status``, ``render``.

Everything here is per user: no file outside the user's home (or data folder), no
administrator rights. Talks to the daemon through ``control.client`` only.
"""

from __future__ import annotations
