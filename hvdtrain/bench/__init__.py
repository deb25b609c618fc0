"""Tooling that measures the trainer, not part of it: ``hvdtrain benchmark`` (``benchmark``),
the allreduce sweep (``comm``), the comparison harness on one machine (``compare``), the same
across nodes (``scaling``), how the variants are started (``variants``) and the scripts a user
would write instead of hvdtrain (``baselines``). ``README.md`` here holds the measurements."""
