"""A user's Keras optimizer given a distributed class for the run and given back after it:
``reduction`` (stage 0: gradients reduced across ranks before ``apply``) and ``zero`` (ZeRO
stages 1-2: each rank updates its piece of every variable and the optimizer state is sharded)."""
