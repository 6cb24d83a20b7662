"""Lowerings (installed as ``zerocompile.passes.lowerings``): rewrites of the final forward,
backward and inference graphs that run after every registered pass and after the collective
summaries, right before the inner compiler (``inner_compilers.runnable``), so no pass, summary or
dump sees what they add. Each turns on with an option, and ``capture.py`` hands them to the inner
compiler in this order:

1. ``comm_timers.insert_comm_timers`` (``comms_logger``): a timer op before each collective the
   comms logger times and after its last wait.
2. ``module_timers.insert_module_marks`` (``flops_profiler``): a mark op at each module boundary.
3. ``watch_collectives.watch_collectives`` (``collective_timeout_s``, a real group of more than one
   rank): every functional collective becomes its watched twin (the collective watchdog).

They are not in the pass registry (``passes/manager.py``) because they change what a graph
measures or how it waits, not what it computes: ``disabled_passes`` cannot name them, and the
pass pipeline's reports and dumps show the graphs without them.
"""
