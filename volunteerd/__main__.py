from __future__ import annotations

from volunteerd.cli import main

raise SystemExit(main())
