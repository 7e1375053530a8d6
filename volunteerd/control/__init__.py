"""The local control API (``api``: the route table), its security (``auth``), the event
log (``events``), the server (``server``) and the typed client (``client``).

The tray and the CLI import ``volunteerd.control.client`` only (it pulls in no server
code); the daemon serves ``api`` through ``server``.
"""
