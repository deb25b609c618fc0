"""Horovod's ``horovod.tensorflow.elastic`` on Keras 3: ``run``, ``TensorFlowState``,
``TensorFlowKerasState`` and ``ObjectState`` (``hvdtrain.dropin_elastic``, shared with
``hvdtrain.keras.elastic``). Refused in one line on the TensorFlow backend."""

from hvdtrain.dropin_elastic import ObjectState, TensorFlowKerasState, TensorFlowState, run

__all__ = ["ObjectState", "TensorFlowKerasState", "TensorFlowState", "run"]
