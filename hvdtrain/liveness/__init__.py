"""No job hangs when a rank dies: each rank's monitor (``watch``: step and phase clocks, stop
requests voted in the step's allreduce, the stall limit) and the probes of peers (``peers``:
heartbeat ports) that tell a slow rank from a dead one."""
