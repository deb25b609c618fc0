"""A run, phase by phase (``run.Run``: setup -> restore -> train -> finish) and what those
phases need: what setup hands the later phases (``prepared``), the data plan, process state set
and put back, world- and data-dependent checks, adapted preprocessing state, memory accounting
and what a run leaves when it ends (``closing``: its result, rank 0's outputs). What one step
computes is ``training.step``; how epochs are driven and ended is ``training.loops``."""
