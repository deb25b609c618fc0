"""Tooling that measures the trainer, not part of it: ``hvdtrain benchmark`` (``benchmark``),
the allreduce sweep (``comm``), the comparison harness on one machine (``compare``), the same
across nodes (``scaling``), how the variants are started (``variants``) and the scripts a user
would write instead of hvdtrain (``baselines``); ZeRO's memory limits (``zero``), fp16 on the
wire (``fp16``), the overlap of buckets with the backward pass (``overlap``, ``profile``,
``step_records``) and Horovod's own tests on the drop-in (``conformance``,
``conformance_plugin``, ``plugin_models``). ``README.md`` here holds the measurements."""
