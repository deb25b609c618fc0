"""What a user would write instead of hvdtrain, timed the same way by ``hvdtrain.bench.compare``.

These are the benchmark's baselines, not part of the trainer: ``minimal_horovod`` imports
Horovod directly (it is the hand-written script hvdtrain must not be slower than), and
``multiworker`` uses TensorFlow's own ``MultiWorkerMirroredStrategy``.
"""
