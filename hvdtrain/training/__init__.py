"""Training: the shared step math, the two loops, callbacks and the learning-rate schedule."""
