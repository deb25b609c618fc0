"""A user's Keras optimizer given a distributed class for the run and given back after it, by one
mechanism (``run_class``): ``reduction`` (stage 0: gradients reduced across ranks before
``apply``; also the drop-in's ``DistributedOptimizer``) and ``zero`` (ZeRO stages 1-2: each rank
updates its piece of every variable, cut by ``sharding``, and the optimizer state is sharded),
and ``accumulation``, the sums over micro-steps both they and the trainer's step keep.
Keras' internals they need are in ``hvdtrain.keras_internals``."""
