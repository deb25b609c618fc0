"""Horovod's elastic states and retry loop for the drop-in: what ``hvdtrain.tensorflow.elastic``
and ``hvdtrain.keras.elastic`` offer, kept below both APIs so that neither imports the other.

Horovod's own states do not work on Keras 3 (``optimizer.variables()`` is a list there) and
broadcast only when built, never at ``sync``; these are the trainer's elastic state: the
variables kept at ``commit``, put back by ``restore``, broadcast from rank 0 by ``sync``.
``ObjectState`` is Horovod's own; ``run`` is Horovod's retry loop, also retrying the grouped
allreduce gradients travel in. Elastic training needs Horovod's driver, so on the TensorFlow
backend, and for Horovod's TensorFlow 1 form, each refuses in one line.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from hvdtrain.dropin import core
from hvdtrain.collectives import tf_variables
from hvdtrain.collectives.horovod_backend import (elastic_retry, horovod_object_state_class,
                                                  keras_elastic_state_class)

ON_HOROVOD = core.BACKEND == "horovod"
_VariablesState: type = keras_elastic_state_class() if ON_HOROVOD else object
_HorovodObjectState: type = horovod_object_state_class() if ON_HOROVOD else object


def _usable(name: str, eagerly: bool = True) -> None:
    """Raise the one-line refusal unless this backend can run the elastic state ``name``
    (``eagerly``: and TensorFlow executes eagerly here)."""
    if not ON_HOROVOD:
        raise core.refused(f"Elastic training (hvd.elastic.{name})")
    if eagerly and not tf.executing_eagerly():
        raise ValueError(f"hvd.elastic.{name} works eagerly (TensorFlow 2); build it outside "
                         "a TensorFlow 1 graph or tf.function")


def run(function: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``elastic.run``: ``function(state, ...)`` is rerun from the last commit
    whenever the world changes."""
    if not ON_HOROVOD:
        raise core.refused("Elastic training (hvd.elastic.run)")
    return elastic_retry(function)


class ObjectState(_HorovodObjectState):
    """Horovod's ``ObjectState(bcast_object, get_rank, **attributes)``."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        _usable("ObjectState", eagerly=False)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **kwargs)


class TensorFlowState(_VariablesState):
    """Horovod's ``TensorFlowState``: a list of variables (TensorFlow or Keras 3) and picklable
    attributes, committed, restored and synchronised together."""

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        _usable("TensorFlowState")
        if session is not None:
            raise ValueError("hvd.elastic.TensorFlowState(session=...) is TensorFlow 1's form; "
                             "pass the variables and no session")
        super().__init__(tf_variables(list(variables or [])), **kwargs)


class KerasState(_VariablesState):
    """The model, its optimizer (``model.optimizer`` unless given) and picklable attributes,
    committed, restored and synchronised together. Keras 3 creates an optimizer's variables
    lazily, so the state builds the optimizer first: every rank then tracks the same variables
    from the first commit on."""

    _name = "KerasState"

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any) -> None:
        _usable(self._name)
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        super().__init__(tf_variables(model.variables + self.optimizer.variables), **kwargs)


class TensorFlowKerasState(KerasState):
    """Horovod's ``TensorFlowKerasState``: ``KerasState`` (``backend``, TensorFlow 1's Keras
    session, has no use in Keras 3 and is ignored)."""

    _name = "TensorFlowKerasState"

    def __init__(self, model: keras.Model, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
