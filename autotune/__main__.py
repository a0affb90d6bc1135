"""``python -m autotune`` is the ``autotune`` command."""

import sys

from autotune.cli import main

sys.exit(main())
