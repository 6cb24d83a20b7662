"""Per-parameter shard state: flat, padded, equal-size shards.

The state hangs off the ``nn.Parameter`` itself (attribute ``_zerocompile``), so a
parameter used by several compiled frames (tied embedding / LM head, graph
breaks) has exactly one shard, one gradient and one optimizer state. The
parameter keeps its identity, shape and stride, so Dynamo's guards keep passing.

Layout for a parameter of ``numel`` elements on ``world`` ranks: ``chunk =
ceil(numel / world)``; the flat parameter is zero-padded to ``chunk * world``
and rank ``r`` owns elements ``[r * chunk, (r + 1) * chunk)``.

What each stage holds per rank (compute dtype = ``param_dtype``):

- stage 0: the parameter itself (full, original dtype); no shard.
- stage 1: a full replica in the compute dtype that autograd accumulates full
  gradients into, plus the master shard (original dtype). With the compute
  dtype equal to the parameter's, the replica *is* the parameter (its data now
  lives in a padded flat buffer) and the master shard is a view into it.
- stage 2: the same replica, which takes no gradient; gradients are
  reduce-scattered into ``shard.grad`` inside the backward graph.
- stage 3: only the master shard; the parameter's storage is freed and the
  graph all-gathers the shard. With ``offload_param`` the shard's values live in a
  file (``shard_file``) and its own storage is freed too (``runtime/param_offload.py``).

Where the parameter's own storage is freed (stage 3, and stages 1/2 with a
different compute dtype), ``materialize()`` gathers it back on demand.

Everything that depends on the stage is asked of ``self.rules``, the stage's ``Stage``
(``runtime/stages.py``).
"""

from __future__ import annotations

import functools
import itertools

import torch

from zerocompile import _torch_compat
from zerocompile.runtime.dcp_shards import sharded_tensor
from zerocompile.runtime.comm import CommGroup, all_gather_flat, chunk_size
from zerocompile.runtime.grad_view import sharded_gradient
from zerocompile.runtime.offload_settings import OffloadSettings
from zerocompile.runtime.param_offload import resident_shards
from zerocompile.runtime.stages import Stage, stage_rules
from zerocompile.runtime.raw_grad import raw_grad, set_raw_grad

_ATTR = "_zerocompile"


def _on_plain_tensors(method):
    """Run ``method`` with ``ZeroParameter``'s eager checks off: it is zerocompile's own work on
    the parameter (gathering it back, writing updated values)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _torch_compat.plain_tensor_ops():
            return method(*args, **kwargs)
    return wrapper


class ShardedParam:
    """Shard state of one parameter. Created once, by the first frame that uses it."""

    def __init__(self, param: torch.nn.Parameter, name: str, stage: int, group: CommGroup,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
                 keep_full: bool = False, offload_param: OffloadSettings = OffloadSettings(),
                 chunk: torch.Tensor | None = None, provisional: bool = False):
        if not param.is_contiguous():
            raise ValueError(
                f"zerocompile: parameter '{name}' is not contiguous (stride {param.stride()}); "
                "make it contiguous before torch.compile (e.g. p.data = p.data.contiguous())")
        self.param = param
        self.name = name
        self.stage = stage
        self.offload_param = offload_param
        """The frame's ``offload_param`` option (compared when another frame uses the parameter)."""
        self.shard_file = None
        """Stage 3 with ``offload_param``: the ``ShardFile`` holding the master shard, whose own
        storage is empty except inside ``resident_shards`` (``runtime/param_offload.py``)."""
        self.shard_resident = 0       # nesting depth of resident_shards over this shard
        self.shard_version = 0        # the shard's version counter when it was read back
        self.rules: Stage = stage_rules(stage, offloads_param(offload_param, param.device))
        self.group = group
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.dtype = param.dtype
        self.device = param.device
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.requires_grad = param.requires_grad
        self.chunk = chunk_size(self.numel, group.world)
        self.padded_numel = self.chunk * group.world
        self.replica: torch.Tensor | None = None   # full tensor in compute dtype (stages 1, 2)
        self.shard: torch.Tensor | None = None      # master shard, leaf (stages 1, 2, 3)
        self.keep_full = keep_full
        """Keep the parameter's own full storage (owned by a module Dynamo never compiles)."""
        self.gradient_reduction = None
        """Stages 1/2: the ``ReductionChoice`` of the frame that sharded it
        (``runtime/reduction_choice.py``): which collective reduces its gradient's bucket."""
        self.session = None
        """The ``ModelSession`` of the model this parameter belongs to (``runtime/session.py``), set
        when the session takes it (``ModelSession.add_state``): the options of the step
        (``gradient_clipping``, ``offload_optimizer``, ``allow_unsharded``, ``loss_scale``,
        ``bucket_mb``) are its model's (``option``), not copies on each state."""
        self.storage_freed = False
        self.materialized = False
        self.eager_holds = 0
        """How many eager module runs (forward, or backward) need the full values now
        (``hold`` / ``unhold``, ``runtime/eager_regions.py``)."""
        self.gathered_by_hooks = False
        """The full values were gathered by ``hold`` (so the last ``unhold`` frees them)."""
        self.eager_regions = None
        """The ``EagerRegions`` of the model whose eager units hold this parameter (None: none
        installed): gathers on demand for a module forward that uses it without owning it."""
        self.eager_grad_hook = False
        """The post-accumulate-grad hook that reduce-scatters eager gradients is registered."""
        self.grad_synced = False
        """The parameter's own ``.grad`` holds the gradient averaged over ranks (set by
        ``ZeroOptimizer`` once it reduced it; cleared by the next forward and by zero_grad)."""
        self.grad_reduced = False
        """``ZeroOptimizer`` reduced this parameter's gradient and no compiled forward has run
        since whose backward could add to it (set by its reduction; cleared by a forward with
        grad enabled, by zero_grad, and at stage 1 by the step that drops the shard gradient)."""
        self.grad_unscaled = False
        """The shard gradient was divided by the ``loss_scale`` option's scale (cleared with it)."""
        self.reduced_grad_version: int | None = None
        """Stage 1: the shard gradient's ``_version`` right after ``ZeroOptimizer`` reduce-scattered
        it (None: not reduced), to see whether anything changed it in place since."""
        self.provisional = provisional
        """Made by ``zerocompile.materialize`` (stage-3 layout, default options) before any frame
        compiled; the first frame adopts it with its own options (``capture``)."""
        with _torch_compat.plain_tensor_ops():
            if chunk is not None:
                # this rank's chunk, cut already (materialize, load_pretrained): the parameter's
                # storage holds nothing to read
                if self.rules is not stage_rules(3):
                    raise ValueError("ShardedParam: a pre-cut chunk is a stage-3 shard")
                self.shard = chunk.detach().to(self.dtype)     # the caller's fresh tensor: no copy
                if self.shard.numel() != self.chunk:
                    raise ValueError(f"ShardedParam: chunk of {self.shard.numel()} elements, expected {self.chunk}")
                self.shard.requires_grad_(self.requires_grad)
                self._free_param_storage()
            else:
                self._build(param.detach())

    def option(self, section: str, name: str, default=None):
        """The model's option ``name`` of ``section`` (``ZeroConfig.step``, ``.passes``, ...: its
        session's options, ``runtime/session.py``), or ``default`` where no compiled frame has
        given the model options yet."""
        config = self.session.config if self.session is not None else None
        return default if config is None else getattr(getattr(config, section), name)

    # -- construction -----------------------------------------------------------------

    def _own_chunk(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        start = self.group.rank * self.chunk
        out = flat.new_zeros(self.chunk, dtype=dtype)   # new_zeros: a fake parameter (plan) gets a fake shard
        stop = min(start + self.chunk, self.numel)
        if stop > start:
            out[: stop - start].copy_(flat[start:stop])
        return out

    def _build(self, data: torch.Tensor) -> None:
        self.rules.build(self, data.reshape(-1))
        if self.shard is not None:
            self.shard.requires_grad_(self.requires_grad)

    def _free_param_storage(self) -> None:
        if self.keep_full:
            return
        self.storage_freed = True
        if _torch_compat.held_by_autograd(self.param):
            # eager code of this step used the parameter before this frame sharded it (a frame
            # Dynamo skipped, a graph break's eager region): its autograd graph may read the
            # values in backward. They stay, as if gathered on demand, until the next optimizer
            # step releases them (runtime/eager_regions.py)
            self.materialized = True
            return
        self.param.untyped_storage().resize_(0)

    @property
    def param_is_master(self) -> bool:
        """The parameter's own storage is the full master value (stage 0, or stages 1/2 with
        no separate compute dtype, where the parameter lives in the flat replica)."""
        return self.rules.param_is_master(self)

    @property
    def separate_full_param(self) -> bool:
        """The parameter keeps a full copy apart from the shard/replica, refreshed after each step."""
        return self.keep_full and not self.param_is_master

    @_on_plain_tensors
    def refresh_param(self, gathered: torch.Tensor) -> None:
        """Write all-gathered master values (parameter dtype; every rank's chunk, in rank order:
        padded flat or a ``(world, chunk)`` view) into the parameter."""
        with torch.no_grad():
            self.param.copy_(gathered.reshape(-1)[: self.numel].view(self.shape))

    # -- what the compiled graph receives ---------------------------------------------
    def graph_inputs(self) -> tuple[torch.Tensor, ...]:
        """The runtime tensors that replace the parameter argument of a compiled frame."""
        return self.rules.graph_inputs(self)

    # -- after the optimizer updated the shard ----------------------------------------
    @_on_plain_tensors
    def full_from_shards(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full current value as a new tensor: a copy of the parameter where it holds the
        full master value (stage 0; stages 1/2 without a separate compute dtype), otherwise an
        all-gather of the master shards (collective)."""
        if self.param_is_master:
            return self.param.detach().to(dtype or self.dtype).clone()
        with resident_shards([self]):    # offload_param: the values are read back for the gather
            gathered = all_gather_flat(self.shard.detach().to(dtype or self.dtype), self.group.world,
                                       self.group.name)
            return gathered[: self.numel].view(self.shape).clone()

    @_on_plain_tensors
    def refresh_replica(self, gathered: torch.Tensor) -> None:
        """Write all-gathered updated values (compute dtype; every rank's chunk, in rank order:
        padded flat or a ``(world, chunk)`` view, copied without an intermediate; or the replica
        itself, received in place: ``replica_place``) into the replica."""
        if gathered.data_ptr() != self._flat_replica.data_ptr():
            self._flat_replica.view(gathered.shape).copy_(gathered)
        if self.materialized:
            self.param.data.copy_(self._flat_replica[: self.numel].view(self.shape).to(self.dtype))

    @property
    def replica_place(self) -> torch.Tensor:
        """Stages 1/2: the replica's padded flat buffer, where the refresh may receive every
        rank's chunk in place (this rank's chunk is the shard itself when the compute dtype is
        the master dtype)."""
        return self._flat_replica

    # -- eager access to a parameter whose storage was freed ----------------------------
    @_on_plain_tensors
    def materialize(self) -> None:
        """Gather the full parameter back into its own storage (collective). The parameter's
        version counter stays as it was: an autograd graph that saved the parameter in an eager
        forward reads the gathered values in its backward."""
        if not self.storage_freed or self.materialized:
            return
        full = self.full_from_shards()
        self.param.untyped_storage().resize_(self.numel * self.param.element_size())
        with torch.no_grad(), _torch_compat.preserving_version(self.param):
            self.param.copy_(full)
        self.materialized = True

    def release(self) -> None:
        """Free the storage ``materialize()`` filled (after the optimizer changed the shard),
        unless an eager module run holds it (``hold``). (Called on every parameter each step:
        the common case, nothing materialized, enters no context.)"""
        if self.materialized and self.eager_holds == 0:
            with _torch_compat.plain_tensor_ops():
                self.param.untyped_storage().resize_(0)
            self.materialized = False
            self.gathered_by_hooks = False

    def hold(self) -> None:
        """An eager module run needs the full values: gather them if they are freed (a
        collective) and count the use."""
        if self.values_freed():
            self.materialize()
            self.gathered_by_hooks = True
        self.eager_holds += 1

    def unhold(self) -> None:
        """An eager module run no longer needs the full values; the last one frees what ``hold``
        gathered (values gathered otherwise stay until the step, as before)."""
        self.eager_holds = max(self.eager_holds - 1, 0)
        if self.eager_holds == 0 and self.gathered_by_hooks:
            self.release()

    @_on_plain_tensors
    def write_full(self, full: torch.Tensor) -> None:
        """Scatter new full values of the parameter into the shard and replica (local, no comm)."""
        flat = full.detach().reshape(-1)
        with torch.no_grad():
            if not self.rules.shards_master:
                self.param.copy_(full)
                return
            with resident_shards([self], write=True):
                self.shard.copy_(self._own_chunk(flat.to(self.dtype), self.dtype))
            if self.rules.keeps_replica:
                self._flat_replica[: self.numel].copy_(flat)
            if self.materialized:
                self.param.copy_(full)

    # -- state dicts (model.state_dict(), ZeroOptimizer.state_dict()) --------------------
    def own_range(self) -> tuple[int, int]:
        """The flat elements ``[start, stop)`` of the parameter this rank's shard holds (empty
        for a rank past the end: its shard is all padding)."""
        start = min(self.group.rank * self.chunk, self.numel)
        return start, min(start + self.chunk, self.numel)

    def sharded_value(self, flat: torch.Tensor) -> torch.Tensor:
        """A tensor of the parameter's shape whose shard on this rank is ``flat`` (``chunk``
        elements, zero-padded: the master shard or element-wise optimizer state), as state
        dicts give it: a ``DTensor`` over the shards on several ranks
        (``zerocompile.runtime.dcp_shards.sharded_tensor``), the whole tensor (a view) on one."""
        start, stop = self.own_range()
        if self.group.world == 1:
            return flat[: self.numel].view(self.shape)
        return sharded_tensor(flat[: stop - start], self.shape, start, self.group.group)

    @_on_plain_tensors
    def state_dict_value(self) -> torch.Tensor:
        """The parameter's value in ``model.state_dict()`` where its storage is freed: its
        master shard as ``sharded_value`` (a copy of it where the shard lives in a file)."""
        shard = self.shard.detach()
        if self.shard_file is not None:
            with resident_shards([self]):
                shard = shard.clone()
        return self.sharded_value(shard)

    @_on_plain_tensors
    def write_own_elements(self, values: torch.Tensor) -> None:
        """Write the flat elements ``own_range()`` of new master values into the shard, and
        refresh what holds full values from the shards (a replica; a gathered parameter): an
        all-gather then, a collective every rank makes."""
        start, stop = self.own_range()
        with torch.no_grad():
            with resident_shards([self], write=True):
                self.shard[: stop - start].copy_(values.reshape(-1))
            if not (self.rules.keeps_replica or self.materialized):
                return
            with resident_shards([self]):
                gathered = all_gather_flat(self.shard.detach(), self.group.world, self.group.name)
            if self.rules.keeps_replica:
                self._flat_replica.copy_(gathered.to(self._flat_replica.dtype))
            if self.materialized:
                self.param.copy_(gathered[: self.numel].view(self.shape))

    # -- what eager code may do with the parameter (runtime/zero_parameter.py) ------------
    def values_freed(self) -> bool:
        """The parameter's own storage holds no values now."""
        return self.storage_freed and not self.materialized

    def grad_is_exact(self) -> bool:
        """``p.grad`` is the gradient a single process would have: stage 0 (and stage 1, where
        the parameter is the replica autograd accumulates into) on one rank, or averaged
        over ranks by ``ZeroOptimizer``."""
        if self.rules.grad_on_param(self):
            return self.group.world == 1 or self.grad_synced
        return False

    def pending_gradients(self) -> list[torch.Tensor]:
        """The gradients zerocompile holds for this parameter (its own, the replica's, the shard's)."""
        holders = {id(t): t for t in (self.param, self.replica, self.shard) if t is not None}
        return [g for t in holders.values() if (g := raw_grad(t)) is not None]

    def reduced_gradient(self):
        """The gradient averaged over ranks, as this rank holds it, once ``ZeroOptimizer`` reduced
        it (None before, or where it lives in the parameter's own ``.grad``): on one rank the
        whole gradient (a view of the shard gradient in the parameter's shape); on several a
        ``DTensor`` of the flattened gradient, ``Shard(0)`` over the group, whose local part is
        a view of this rank's shard gradient (``runtime/grad_view.py``)."""
        if not (self.rules.shards_master and self.grad_reduced):
            return None
        grad = raw_grad(self.shard)
        if grad is None:
            return None
        if self.group.world == 1:
            return grad[: self.numel].view(self.shape)
        return sharded_gradient(grad, self.numel, self.group)

    def forget_reduction(self) -> None:
        """The gradients were cleared or zeroed: nothing is reduced or unscaled any more."""
        self.grad_synced = False
        self.grad_reduced = False
        self.grad_unscaled = False
        self.reduced_grad_version = None

    def where_gradient_lives(self) -> str:
        if self.rules.reduces_in_backward:
            return (f"at stage {self.stage} its gradient is reduce-scattered into flat shards, "
                    f"1/{self.group.world} of it on each rank")
        return ("it holds this rank's local, not yet averaged gradient until ZeroOptimizer.step() "
                "reduces it")

    def clear_gradients(self) -> None:
        """Drop every gradient zerocompile keeps for this parameter (``p.grad = None``)."""
        for t in (self.replica, self.shard):
            if t is not None and t is not self.param:
                set_raw_grad(t, None)
        self.forget_reduction()

    # -- accounting -------------------------------------------------------------------
    def storages(self) -> tuple[dict[int, int], dict[int, int]]:
        """``({storage key: bytes})`` of parameter data and of gradients this state keeps alive,
        keyed by the storage object (``_cdata``, as ``LiveStorageTracker`` keys them), which fake
        tensors (``zerocompile plan``) have too, unlike a data pointer."""
        params, grads = {}, {}
        for t in (self.param, self.replica, self.shard):
            if t is not None:
                st = t.untyped_storage()
                if st.nbytes() > 0:
                    params[st._cdata] = st.nbytes()
                grad = raw_grad(t)
                if grad is not None:
                    grads[grad.untyped_storage()._cdata] = grad.untyped_storage().nbytes()
        return params, grads


def offloads_param(settings: OffloadSettings, device: torch.device) -> bool:
    """Whether ``offload_param`` = ``settings`` moves the shards of a parameter on ``device``
    (``"cpu"`` does not when the parameter is on the CPU already)."""
    return settings.device == "nvme" or (settings.device == "cpu" and device.type != "cpu")


def get_state(param: torch.Tensor) -> ShardedParam | None:
    """The shard state of ``param``, or None if no compiled frame has used it yet."""
    return getattr(param, _ATTR, None)


def states_of(params) -> list:
    """``[get_state(p) for p in params]``, read without a Python call per parameter (an
    optimizer step reads them all)."""
    return list(map(getattr, params, itertools.repeat(_ATTR), itertools.repeat(None)))


def detach_state(param: torch.nn.Parameter) -> None:
    """Remove ``param``'s shard state (a provisional one, replaced by the first frame's)."""
    if hasattr(param, _ATTR):
        delattr(param, _ATTR)


def attach_state(param: torch.nn.Parameter, state: ShardedParam) -> None:
    """Hang ``state`` off ``param``. ``compile_frame`` makes it a ``ZeroParameter`` once the
    frame has compiled (``capture._adopt_parameters``), before Dynamo builds the guards."""
    setattr(param, _ATTR, state)
