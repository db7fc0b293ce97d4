"""`python -m cyclone.cli`: the same as the `cyclone` console script."""

from __future__ import annotations

import sys

from cyclone.cli import main

sys.exit(main())
