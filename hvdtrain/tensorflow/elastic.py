"""Horovod's ``horovod.tensorflow.elastic`` on Keras 3: ``run``, ``TensorFlowState``,
``TensorFlowKerasState`` and ``ObjectState`` (``hvdtrain.dropin.elastic``, shared with
``hvdtrain.keras.elastic``). Refused in one line on the TensorFlow backend."""

from hvdtrain.dropin.elastic import ObjectState, TensorFlowKerasState, TensorFlowState, run

__all__ = ["ObjectState", "TensorFlowKerasState", "TensorFlowState", "run"]
