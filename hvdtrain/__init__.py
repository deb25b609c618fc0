"""hvdtrain: data-parallel training of TensorFlow/Keras 3 models with Horovod over MPI."""

__version__ = "0.1.0"
