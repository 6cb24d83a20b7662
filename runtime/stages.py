"""What each ZeRO stage keeps and does, in one place.

A ``Stage`` answers every stage-dependent question about one parameter: which tensors it
builds (``build``), which tensors stand for the parameter in a compiled graph
(``input_suffixes``, ``graph_inputs``) and what the graph computes from them
(``insert_param_op``), where the backward leaves the gradient (``grad_holder``), what the
optimizer updates (``optimizer_target``), and what it reduces and refreshes around the
update (``reduces_in_step``, ``keeps_replica``). ``ShardedParam``
(``runtime/sharded_param.py``), the ``insert_param_collectives`` pass, ``ZeroOptimizer``,
loss scaling and checkpoints ask the parameter's ``ShardedParam.rules`` rather than its stage
number. Variants that change how a parameter travels (quantized gathers, offloaded shards)
are new ``Stage`` classes answering the same questions (``Stage3Offload``: shards in files).

=====  ==================  ======================  =================  ====================
stage  between steps       graph input(s)          gradient lands in  optimizer step
=====  ==================  ======================  =================  ====================
0      the parameter       the parameter           ``param.grad``     all-reduce, update p
1      replica + shard     the replica             ``replica.grad``   reduce-scatter, update
                                                                      shard, gather replica
2      replica + shard     shard, replica          ``shard.grad``     update shard, gather
                                                   (in backward)      replica
3      shard               shard (gathered in      ``shard.grad``     update shard
                           the graph)              (in backward)
=====  ==================  ======================  =================  ====================
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.runtime import param_ops
from zerocompile.runtime.param_offload import ShardFile, fetch_shard, param_directory


class Stage:
    """The rules of one stage (see the module docstring). Instances hold no state."""

    number: int
    input_suffixes: tuple[str, ...]
    """Graph inputs that replace a parameter, by the suffix added to its placeholder's name
    (``""``: the parameter itself, ``"_replica"``, ``"_shard"``), in ``graph_inputs`` order."""
    shards_master: bool
    """The master value lives in flat shards (stages 1-3); stage 0 keeps the parameter."""
    keeps_replica: bool
    """A full replica in the compute dtype lives between steps (stages 1, 2): refreshed by an
    all-gather after each optimizer step."""
    reduces_in_step: bool
    """Full gradients accumulate locally and the optimizer step reduce-scatters them into the
    shard (stage 1; or all-reduces their buckets and keeps this rank's slice, as the
    ``gradient_reduction`` option chooses); stage 0 all-reduces them instead; stages 2/3
    reduce inside the backward."""
    reduces_in_backward: bool
    """The backward graph reduce-scatters the gradient into ``shard.grad`` (stages 2, 3)."""
    op_role: str | None
    """``node.meta["zerocompile"]["role"]`` of the op ``insert_param_op`` adds (None: none)."""
    output_alias_drops_grad: bool = False
    """A graph output that aliases the parameter's graph input would lose its gradient
    (AOTAutograd rebuilds it from an input that takes none), so the pass clones it."""

    # -- tensors ----------------------------------------------------------------------
    def build(self, sp, flat: torch.Tensor) -> None:
        """Create ``sp``'s shard / replica from the parameter's current values ``flat``."""

    def param_is_master(self, sp) -> bool:
        """The parameter's own storage is the full master value."""
        raise NotImplementedError

    def graph_inputs(self, sp) -> tuple[torch.Tensor, ...]:
        """The runtime tensors that replace the parameter argument of a compiled frame."""
        raise NotImplementedError

    def grad_holder(self, sp) -> torch.Tensor:
        """The tensor whose ``.grad`` the compiled backward fills for this parameter."""
        raise NotImplementedError

    def optimizer_target(self, sp) -> torch.Tensor:
        """The tensor the inner optimizer updates."""
        return sp.shard

    def grad_on_param(self, sp) -> bool:
        """Autograd accumulates the full gradient into the parameter object itself."""
        return self.grad_holder(sp) is sp.param

    # -- graphs -----------------------------------------------------------------------
    def insert_param_op(self, graph: torch.fx.Graph, inputs: list, sp, group) -> torch.fx.Node:
        """Add (at the graph's current insertion point) what the graph computes the parameter
        from ``inputs`` (the new placeholders); return the node that replaces the parameter."""
        raise NotImplementedError


class Stage0(Stage):
    number = 0
    input_suffixes = ("",)
    shards_master = False
    keeps_replica = False
    reduces_in_step = False
    reduces_in_backward = False
    op_role = "param_cast"

    def param_is_master(self, sp) -> bool:
        return True

    def graph_inputs(self, sp):
        return (sp.param,)

    def grad_holder(self, sp):
        return sp.param

    def optimizer_target(self, sp):
        return sp.param

    def insert_param_op(self, graph, inputs, sp, group):
        if sp.compute_dtype == sp.dtype:
            return inputs[0]
        return graph.call_function(param_ops.cast_param, (inputs[0], sp.compute_dtype))


class _Replicated(Stage):
    """Stages 1 and 2: a full compute-dtype replica between steps, master values in shards."""

    shards_master = True
    keeps_replica = True

    def build(self, sp, flat):
        buf = flat.new_zeros(sp.padded_numel, dtype=sp.compute_dtype)   # fake for a fake parameter (plan)
        buf[: sp.numel].copy_(flat)
        full = buf[: sp.numel].view(sp.shape)
        start = sp.group.rank * sp.chunk
        if sp.compute_dtype == sp.dtype:
            sp.param.data = full                   # same storage: no second copy
            sp.shard = buf[start : start + sp.chunk].detach()
            sp.replica = sp.param if self.reduces_in_step else full.detach()
        else:
            sp.shard = sp._own_chunk(flat, sp.dtype)
            sp.replica = full.detach().requires_grad_(self.reduces_in_step and sp.requires_grad)
            sp._free_param_storage()
        sp._flat_replica = buf

    def param_is_master(self, sp) -> bool:
        return sp.compute_dtype == sp.dtype


class Stage1(_Replicated):
    number = 1
    input_suffixes = ("_replica",)
    reduces_in_step = True
    reduces_in_backward = False
    op_role = None

    def graph_inputs(self, sp):
        return (sp.replica,)

    def grad_holder(self, sp):
        return sp.replica

    def insert_param_op(self, graph, inputs, sp, group):
        return inputs[0]


class Stage2(_Replicated):
    number = 2
    input_suffixes = ("_shard", "_replica")
    reduces_in_step = False
    reduces_in_backward = True
    op_role = "grad_reduce_scatter"
    output_alias_drops_grad = True

    def graph_inputs(self, sp):
        return (sp.shard, sp.replica)

    def grad_holder(self, sp):
        return sp.shard

    def insert_param_op(self, graph, inputs, sp, group):
        return graph.call_function(param_ops.replica_with_sharded_grad, (
            inputs[0], inputs[1], sp.numel, sp.reduce_dtype, group.world, group.name))


class Stage3(Stage):
    number = 3
    input_suffixes = ("_shard",)
    shards_master = True
    keeps_replica = False
    reduces_in_step = False
    reduces_in_backward = True
    op_role = "param_gather"

    def build(self, sp, flat):
        sp.shard = sp._own_chunk(flat, sp.dtype)
        sp._free_param_storage()

    def param_is_master(self, sp) -> bool:
        return False

    def graph_inputs(self, sp):
        return (sp.shard,)

    def grad_holder(self, sp):
        return sp.shard

    def insert_param_op(self, graph, inputs, sp, group):
        # gathered in the shard's dtype, then cast: the cast_before_gather pass moves the
        # cast in front of the all-gather
        out = graph.call_function(param_ops.gather_param, (
            inputs[0], sp.numel, sp.shape, sp.dtype, sp.reduce_dtype, group.world, group.name))
        if sp.compute_dtype == sp.dtype:
            return out
        out.meta["zerocompile"] = {"role": self.op_role, "param": sp.name}
        cast = graph.call_function(param_ops.cast_param, (out, sp.compute_dtype))
        cast.meta["zerocompile"] = {"role": "gather_cast", "param": sp.name}
        return cast


class Stage3Offload(Stage3):
    """Stage 3 with ``offload_param``: the master shard lives in a file between uses
    (``runtime/param_offload.py``); the graph fetches it right before its all-gather. The
    second graph input is the number of the parameter's file (never a constant of the graph:
    one compiled frame runs for many blocks' parameters)."""

    input_suffixes = ("_shard", "_file")

    def build(self, sp, flat):
        super().build(sp, flat)
        sp.shard_file = ShardFile(param_directory(sp.offload_param), sp.name, sp.shard)
        sp.shard.untyped_storage().resize_(0)

    def graph_inputs(self, sp):
        return (sp.shard, sp.shard_file.number_tensor)

    def insert_param_op(self, graph, inputs, sp, group):
        fetched = graph.call_function(fetch_shard, (inputs[0], inputs[1], param_directory(sp.offload_param)))
        fetched.meta["zerocompile"] = {"role": "param_fetch", "param": sp.name}
        return super().insert_param_op(graph, [fetched], sp, group)


_STAGES = (Stage0(), Stage1(), Stage2(), Stage3())
_STAGE3_OFFLOAD = Stage3Offload()


def stage_rules(stage: int, offload_param: bool = False) -> Stage:
    """The ``Stage`` of ZeRO stage ``stage`` (0-3); ``offload_param``: stage 3's shards live in
    files (``Stage3Offload``)."""
    if offload_param:
        if stage != 3:
            raise ValueError(f"offload_param needs stage 3 (parameters are sharded only there), not stage {stage}")
        return _STAGE3_OFFLOAD
    return _STAGES[stage]
