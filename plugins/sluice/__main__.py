"""``python -m sluice``: the ``sluice`` command line of a checkout (``sluice.cli``)."""

import sys

from sluice.cli import main

sys.exit(main())
