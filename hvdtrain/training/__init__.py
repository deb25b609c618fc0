"""A run, phase by phase (``run.Run``: setup -> restore -> train -> finish) and what those
phases need: the data plan, process state set and put back, world- and data-dependent checks,
adapted preprocessing state, memory accounting and rank 0's closing outputs. What one step
computes is ``training.step``; how epochs are driven and ended is ``training.loops``."""
