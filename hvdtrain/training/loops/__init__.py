"""The loops that drive a step through epochs and what runs during them. ``driver.LOOPS`` names
the three loops (Keras' ``fit``, the custom ``tf.function`` loop, Horovod's elastic loop in
``elastic``), each taking the run's ``driver.Training``; the custom loop and each world of the
elastic loop run the one epoch driver (``epochs``), ``fit`` runs Keras' own batch loop. Every
loop ends an epoch with ``epoch_end`` (metrics, validation, the user's callbacks, checkpoint,
reports, in that order); ``checkpointing`` is the checkpoints and stops during the run,
``run_callbacks`` the run's own callbacks, ``run_columns`` the columns kept beside Keras' logs."""
