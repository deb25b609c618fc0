"""Tooling that measures the trainer, not part of it: ``hvdtrain benchmark`` (``benchmark``),
the allreduce sweep (``comm``), the comparison harness (``compare``) and the scripts a user
would write instead of hvdtrain (``baselines``)."""
