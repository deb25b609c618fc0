"""``python -m hvdtrain``: the same entry point as the ``hvdtrain`` console script."""

from hvdtrain.cli import entry

entry()
