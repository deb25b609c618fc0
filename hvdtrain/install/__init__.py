"""Tooling that installs and checks the trainer's runtime, not part of it: the Horovod build
with its fix for current TensorFlow (``horovod_build``) and ``hvdtrain doctor`` (``doctor``)."""
