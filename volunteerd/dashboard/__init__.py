"""The dashboard's static files (``static/``), served by the control API at ``/``."""
