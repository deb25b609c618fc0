"""The data a run's config names: a built-in source, or a user's ``package.module:fn``.

The one place that knows both kinds of producer (``hvdtrain.data.sources`` and
``hvdtrain.data.user``), so that neither needs the other; both make what
``hvdtrain.data.contract`` describes.
"""

from __future__ import annotations

from hvdtrain.config import PYTHON_OBJECT, DataConfig
from hvdtrain.data.contract import DataBundle, DataError, checked_bundle
from hvdtrain.data.sources import SOURCES
from hvdtrain.data.user import user_bundle
from hvdtrain.plugins import is_plugin, load_callable


def load_source(config: DataConfig, seed: int) -> DataBundle:
    """Load the configured source: a built-in by name, or a user's ``package.module:fn``."""
    if is_plugin(config.dataset):
        return user_bundle(load_callable(config.dataset, "dataset")(), config, seed)
    if config.dataset == PYTHON_OBJECT:
        raise DataError("this run's data was handed to hvdtrain.fit in Python and cannot be "
                        "loaded by name; pass the data again (or --data-path FILE.npz)")
    loader = SOURCES.get(config.dataset)
    if loader is None:
        raise DataError(f"unknown dataset '{config.dataset}'; choose one of "
                        f"{', '.join(SOURCES)} or give package.module:fn")
    return checked_bundle(loader(config, seed), config.dataset)
