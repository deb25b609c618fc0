"""Horovod's Keras and TensorFlow API on Keras 3, over the trainer's collectives; ``hvdtrain.keras``
and ``hvdtrain.tensorflow`` are thin facades over this package. ``core`` holds what the two APIs
share, ``ops`` the reduction and compression constants without Horovod, ``tf_ops`` the names on
TensorFlow's collectives, ``tensor_operations`` the tensor operations under them that the trainer
does not need, ``elastic`` the elastic states. It uses the optimizer wrappers
(``hvdtrain.optimizers``), never the trainer (``hvdtrain.training``)."""
