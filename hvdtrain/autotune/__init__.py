"""``--autotune``: the search over bucket sizes and cycle times (``search``, no TensorFlow)
and its timed trials on the run's own model (``trials``)."""
