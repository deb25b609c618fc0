"""hvdtrain: data-parallel training of Keras 3 models on Horovod's or TensorFlow's collectives.

``hvdtrain.fit`` trains from Python (``hvdtrain.init`` joins the job first, where a script builds
its model before ``fit``); ``hvdtrain.Arrays``, ``hvdtrain.Pipeline`` and
``hvdtrain.Shard`` describe a user's data. They load on first use, so ``import hvdtrain`` (and
the CLI's ``--version`` and ``--help``) stays free of TensorFlow.
"""

__version__ = "0.1.0"

_LAZY = {"fit": "hvdtrain.api", "init": "hvdtrain.api", "Arrays": "hvdtrain.data.user",
         "Pipeline": "hvdtrain.data.user", "Shard": "hvdtrain.data.user"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")
