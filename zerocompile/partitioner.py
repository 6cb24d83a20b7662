"""``ZeroPartitioner``: what AOTAutograd calls in the place of its partitioner for a frame (see
``capture.py``): the joint-graph passes, the min-cut partitioner, the forward and backward
passes, and what the frame's accounting reads from the graphs (collective summaries, saved
activation bytes, the simulated peak, the FLOPs)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
import torch.fx

from zerocompile import _torch_compat, compile_cache
from zerocompile.passes.analyses.collective_summary import summarize_collectives
from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.flop_count import graph_flops
from zerocompile.passes.analyses.liveness import saved_activation_bytes, simulate
from zerocompile.passes.manager import run_passes
from zerocompile.passes.analyses.profiler import profile_graph
from zerocompile.runtime.accounting import CollectiveSummary

log = logging.getLogger("zerocompile")


class ZeroPartitioner(_torch_compat.PartitionerBase):
    """Joint-graph passes, then the min-cut partitioner, then collective summaries."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.backward_summary = CollectiveSummary()
        self.forward_summary: CollectiveSummary | None = None
        self.inference_summary: CollectiveSummary | None = None
        self.ran = False
        """Whether AOTAutograd called it (not on a hit in its cache: ``restore`` then)."""

    def __call__(self, gm, joint_inputs, **kwargs):
        self.ran = True
        self.ctx.num_fwd_outputs = kwargs.get("num_fwd_outputs", 0)
        self._profile(gm.graph)
        gm = run_passes(gm, self.ctx, "joint")
        fw, bw = _torch_compat.min_cut_partition(gm, joint_inputs, **kwargs)
        self.ctx.results["saved_activation_bytes"] = saved_activation_bytes(fw.graph, self.ctx.num_fwd_outputs)
        fw = run_passes(fw, self.ctx, "forward")
        bw = run_passes(bw, self.ctx, "backward")
        # the transient peak a training step of this frame is simulated to reach (the backward
        # counts its inputs: the saved activations and the incoming gradients)
        self.ctx.results["simulated_peak_bytes"] = max(simulate(fw.graph).peak,
                                                       simulate(bw.graph, count_inputs=True).peak)
        fw_flops, bw_flops = graph_flops(fw.graph), graph_flops(bw.graph, backward=True)
        self.ctx.results["flops"] = {"forward": fw_flops["flops"], "backward": bw_flops["flops"],
                                     "recompute": bw_flops["recompute"]}
        self.ctx.results["flops_by_module"] = {"forward": fw_flops["modules"], "backward": bw_flops["modules"]}
        self.forward_summary = summarize_collectives(fw.graph, self.ctx.group.world)
        self.backward_summary = summarize_collectives(bw.graph, self.ctx.group.world)
        log.debug("[%s] forward: %s; backward: %s", self.ctx.frame, self.forward_summary,
                  self.backward_summary)
        return fw, bw

    def inference(self, gm):
        """Passes on the graph of a frame run without autograd (AOTAutograd compiles one
        inference graph and calls no partitioner): tagging, then the forward passes."""
        self.ran = True
        self.ctx.num_fwd_outputs = len(next(iter(gm.graph.find_nodes(op="output"))).args[0])
        self._profile(gm.graph)
        gm = run_passes(gm, self.ctx, "inference")
        self.inference_summary = summarize_collectives(gm.graph, self.ctx.group.world)
        counted = graph_flops(gm.graph)
        self.ctx.results["flops"] = {"forward": counted["flops"], "backward": 0, "recompute": 0}
        self.ctx.results["flops_by_module"] = {"forward": counted["modules"], "backward": {}}
        return gm

    def entry(self) -> compile_cache.FrameEntry:
        """What this partitioner computed besides the graphs, for a restart that hits the caches."""
        cost_model = self.ctx.cost_model.as_dict() if self.ctx.cost_model is not None else None
        return compile_cache.FrameEntry(self.forward_summary, self.backward_summary, self.inference_summary,
                                        dict(self.ctx.results), cost_model)

    def restore(self, entry: compile_cache.FrameEntry) -> None:
        """Take the summaries and results of a compile that AOTAutograd's cache replays."""
        self.forward_summary = entry.forward_summary
        self.backward_summary = entry.backward_summary
        self.inference_summary = entry.inference_summary
        self.ctx.results.update(entry.results)

    def _profile(self, graph: torch.fx.Graph) -> None:
        """With ``profile=True``: replace the estimated cost model by one measured on this
        graph (passes/analyses/profiler.py), before any pass weighs a cost."""
        ctx = self.ctx
        if not ctx.config.compiler.profile or ctx.cost_model is None:
            return
        bucket_bytes = int(ctx.config.passes.bucket_mb * (1 << 20)) if ctx.config.sharding.stage in (2, 3) else 0
        fake = any(_torch_compat.is_fake_tensor(sp.param) for sp in ctx.primal_params if sp is not None)
        ctx.cost_model, ctx.results["profile"] = profile_graph(
            graph, ctx.cost_model, ctx.group, ctx.device or torch.device("cpu"), bucket_bytes, ctx.frame,
            fake_params=fake, offload=ctx.config.passes.offload_activations)

    def __deepcopy__(self, memo):
        # inductor deep-copies its config (which holds this object) when it snapshots it;
        # the context holds a process group, which cannot be copied, and need not be
        return self

    def __reduce__(self):
        # inductor's FX-graph cache key pickles its config, which holds this object; what
        # identifies it is its uuid (the pass code and options), not the context's tensors
        return (str, (self.uuid(),))

    def uuid(self):
        import zerocompile.passes
        import zerocompile.runtime

        dirs = [Path(__file__).parent, Path(zerocompile.passes.__file__).parent,
                Path(zerocompile.runtime.__file__).parent]
        # every module below them (sub-packages too: passes/analyses, _torch_compat, ...)
        files = sorted(f for d in dirs for f in d.rglob("*.py"))
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.read_bytes())
        cfg = self.ctx.config
        # not the probed cost model: what it decides is in the graphs inductor hashes anyway
        digest.update(repr(sorted((k, v) for k, v in cfg.flat().items() if k != "process_group")).encode())
        # the gradient reduction chosen (not its timings): AOTAutograd keys on the Dynamo graph,
        # before the backward pass that writes the choice into the graph
        choice = self.ctx.gradient_reduction
        if choice is not None:
            digest.update(repr((choice.sizes, choice.kinds, choice.gather_kinds)).encode())
        # the rank and group: a backward graph can be rank-specific (all_reduce_gradients slices
        # this rank's rows), and AOTAutograd's key is otherwise the same on every rank, so one
        # rank would load another's graphs from a shared cache directory
        group = self.ctx.group
        digest.update(repr((group.rank, group.world, group.name)).encode())
        return digest.hexdigest()
