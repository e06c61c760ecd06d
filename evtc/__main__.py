"""``python -m evtc``: see :mod:`evtc.cli`."""

import sys

from .cli import main

sys.exit(main())
