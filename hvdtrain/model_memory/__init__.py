"""What a model's layers hold during a step, for models larger than a rank holds.

``recomputed``: a layer's call that TensorFlow computes again for its gradient instead of
keeping what the call made (``tf.recompute_grad``, which Keras' ``remat`` is on TensorFlow),
with what Keras' own rematerialisation misses there: keyword arguments (``training``), the
mixed-precision autocast and call context, the same random draws, the losses the call adds.
``gathered``: ZeRO stage 3, each layer's weights gathered whole inside its call from every
rank's piece. ``remat``: Keras' rematerialisation modes (``RematScope``) applied to a user's
model for the run, each layer Keras would recompute recomputed this way.
"""
