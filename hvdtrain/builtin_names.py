"""The names of the built-in datasets and models: the choices of ``--dataset`` and ``--model``.

The registries they name (``hvdtrain.data.sources.SOURCES``, ``hvdtrain.models.BUILTIN``) load
TensorFlow and Keras, which ``hvdtrain.config`` must not (``hvdtrain --help`` reads it), so the
names live in this leaf, which both import; a test checks that each registry holds exactly
these names, in this order.
"""

DATASETS = ("digits", "synthetic", "npz", "tfrecord", "csv", "mnist", "fashion_mnist", "cifar10")
MODELS = ("mlp", "cnn", "resnet")
