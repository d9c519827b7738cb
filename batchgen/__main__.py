"""``python -m batchgen``: the ``batchgen`` command line."""

import sys

from batchgen.entrypoints.cli import main

sys.exit(main())
