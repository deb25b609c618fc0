"""One training step and what it is made of: ``core`` (Keras' own loss and metrics on a
rank's rows, the gradient exchange under them, the ``TrainingStep`` protocol the loops use),
``own`` (a model's own ``train_step`` over reducing optimizers), ``objective`` (what Keras'
loss divides a batch by, measured once), ``accumulation``, ``sync_batch_norm``, ``trainable``
(which step trains the model and its optimizers) and ``schedule`` (their learning rates)."""
