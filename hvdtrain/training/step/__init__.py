"""One training step and what it is made of: ``core`` (Keras' own loss and metrics on a
rank's rows, the gradient exchange under them, the ``TrainingStep`` protocol the loops use),
``own`` (a model's own ``train_step`` over reducing optimizers), ``votes`` (the ranks' stop
votes the step carries), ``objective`` (what Keras' loss divides a batch by, measured once),
``sync_batch_norm``, ``trainable`` (which step trains the model and its
optimizers), ``schedule`` (their learning rates) and ``for_run`` (the run's step made from the
configuration, with the lines it says about itself)."""
