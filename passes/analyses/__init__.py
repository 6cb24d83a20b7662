"""Analyses of zerocompile's graphs (installed as ``zerocompile.passes.analyses``): they read a
graph and answer a question, and rewrite nothing. The passes (``zerocompile.passes``) and the
partitioner ask them.

- ``param_identity``: which graph nodes belong to which parameter (one answer for every pass).
- ``liveness``: a node-by-node simulation of which tensors are alive, and the peak.
- ``cost_model``: what compute, collectives and offload cost (rates probed or given).
- ``profiler``: a cost model measured on the frame's own graph (``profile`` option).
- ``flop_count``: the FLOPs of a partitioned graph, by torch's formulas.
- ``collective_summary``: a graph's collectives, by kind and bytes (``zerocompile.stats()``).
"""
