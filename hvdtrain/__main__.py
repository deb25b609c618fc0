"""``python -m hvdtrain``: the same entry point as the ``hvdtrain`` console script."""

import sys

from hvdtrain.cli import main

sys.exit(main())
