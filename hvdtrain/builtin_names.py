"""The names of the built-in datasets and models and of the gradients' compressions: the choices
of ``--dataset``, ``--model`` and ``--compression``.

The registries they name (``hvdtrain.data.sources.SOURCES``, ``hvdtrain.models.BUILTIN``) load
TensorFlow and Keras, which ``hvdtrain.config`` must not (``hvdtrain --help`` reads it), so the
names live in this leaf, which both import; a test checks that each registry holds exactly
these names, in this order. ``hvdtrain.collectives.GradientReduction`` checks its compression
against ``COMPRESSIONS``.
"""

DATASETS = ("digits", "synthetic", "npz", "tfrecord", "csv", "mnist", "fashion_mnist", "cifar10")
MODELS = ("mlp", "cnn", "resnet")
COMPRESSIONS = ("none", "fp16", "bf16")
# --compression: the casts on the wire, or PowerSGD (a low-rank approximation, whose uncompressed
# part travels as float32).
GRADIENT_COMPRESSIONS = (*COMPRESSIONS, "powersgd")
