"""The loops that drive a step through epochs (``driver.LOOPS``: Keras' ``fit``, the custom
``tf.function`` loop, the elastic loop), the epoch end every loop runs in code (``epoch_end``),
checkpointing during the run, the run's own callbacks and the columns kept beside Keras' logs."""
