"""What a parameter zerocompile has sharded does when eager code touches it.

Once a compiled frame shards a parameter, the parameter object stays the user's (same
identity, shape, stride, ``isinstance(p, nn.Parameter)``), but its class becomes
``ZeroParameter``, a subclass of ``nn.Parameter`` with two guards:

- **Values.** At stage 3 (and stages 1/2 with a 16-bit ``param_dtype``) the parameter's own
  storage is freed: its values live in flat shards across ranks. Reading it would read freed
  memory (a segmentation fault). Every torch operation on a ``ZeroParameter`` outside
  compiled code first checks the storage: metadata (shape, dtype, device, ...) is always
  readable; any other operation on a freed parameter raises ``ParameterNotGatheredError``,
  which names ``zerocompile.gathered_parameters`` and ``zerocompile.full_state_dict``.
  One write is exact without communication, because every rank holds the whole source:
  ``p.copy_(full_value)`` (what ``load_state_dict`` does) scatters the new value into this
  rank's shard. ``model.state_dict()`` gives the shard as a DTensor (``ShardedParam.state_dict_value``,
  what torch's ``get_model_state_dict`` and DCP work with), and ``p.copy_`` of such a DTensor
  writes it back into the shard; ``torch.zeros_like(p)`` and its kin read the metadata only.
- **Gradients.** ``p.grad`` is the gradient averaged over ranks, as one process on the whole
  batch would have it. On several ranks the first read after a backward asks the
  ``ZeroOptimizer`` that steps the parameter (``gradient_reducer``) to reduce every
  gradient it holds, as its step would: at stages 0 and 1 that is a collective, so every rank
  must read (``torch.nn.utils.clip_grad_norm_`` does, in the same order everywhere); at stages
  2 and 3 the backward reduced them already. Then ``p.grad`` is the averaged full gradient at
  stage 0, and at stages 1-3 a ``DTensor`` of the flattened gradient whose local part is this
  rank's shard gradient (``runtime/grad_view.py``): torch's norm and clipping functions
  compute the global norm and scale the shards the step updates, as with FSDP2. A later
  backward before the step adds to what was reduced, and the optimizer reduces the new part
  again. Without such an optimizer ``p.grad`` raises ``GradientNotGatheredError`` instead
  of returning None or a rank-local value. ``p.grad = None`` clears the gradient wherever
  zerocompile keeps it. ``zero_grad`` of modules and optimizers keeps working: they only test
  ``p.grad is not None`` and then set it to None (which clears zerocompile's gradients through
  the setter) or zero it in place, so they get the tensor that holds the gradient
  (``_torch_compat.called_from_zero_grad``: torch names no other sign of that reader).

Inside compiled code (Dynamo tracing) both guards step aside, so graphs are unchanged.
zerocompile's own code reaches the plain tensor through ``raw_grad`` / ``set_raw_grad``
(``runtime/raw_grad.py``) and ``_torch_compat.plain_tensor_ops()``.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor

from zerocompile import _torch_compat
from zerocompile.errors import GradientNotGatheredError, ParameterNotGatheredError  # noqa: F401  (re-exported)
from zerocompile.runtime.dcp_shards import local_part
from zerocompile.runtime.raw_grad import raw_grad, raw_grads, set_raw_grad  # noqa: F401  (re-exported)
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.sharded_param import get_state

_METADATA_METHODS = frozenset({
    "size", "stride", "dim", "numel", "nelement", "element_size", "is_contiguous", "storage_offset",
    "untyped_storage", "data_ptr", "is_floating_point", "is_complex", "get_device", "__hash__",
    "__reduce_ex__", "__deepcopy__", "_is_view", "is_shared", "is_pinned", "type",
    "register_hook", "register_post_accumulate_grad_hook",      # hooks read no values
})
_METADATA_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "itemsize", "nbytes",
    "names", "_base", "_version", "output_nr", "_cdata", "is_mps", "is_xpu", "retains_grad",
})
_LIKE_FACTORIES = frozenset({"zeros_like", "empty_like", "ones_like", "full_like"})
"""New tensors shaped like the parameter: they read its metadata only."""
_HOW_TO_READ = (
    "Read parameters inside `with zerocompile.gathered_parameters(model): ...` (a collective: every "
    "rank must enter it), take `zerocompile.full_state_dict(model)` for a copy, or save with "
    "`zerocompile.save_checkpoint(...)`.")


def _func_name(func) -> tuple[str, str]:
    """``("get", "shape")`` for an attribute read, ``("set", "data")`` for a write,
    ``("call", "sum")`` for a method or function."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return ("get" if name == "__get__" else "set"), getattr(owner, "__name__", "")
    return "call", name


def _sharded_params(args, kwargs):
    found = []
    for value in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(value, ZeroParameter) and value.zero_state is not None:
            found.append(value)
    return found


class ZeroParameter(torch.nn.Parameter):
    """An ``nn.Parameter`` that zerocompile has sharded (see the module docstring)."""

    @property
    def zero_state(self):
        """The parameter's ``ShardedParam``."""
        return get_state(self)

    @classmethod
    @_torch_compat.never_a_frame
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.compiler.is_compiling():
            for param in _sharded_params(args, kwargs):
                special = _check_eager_use(param, func, args, kwargs)
                if special is not None:
                    return special()
        with _torch_compat.plain_tensor_ops():
            return func(*args, **kwargs)

    @property
    def grad(self):
        state = self.zero_state
        grad = raw_grad(self)
        if state is None or _torch_compat.inside_dynamo_trace() or state.grad_is_exact():
            return grad
        pending = state.pending_gradients()
        if not pending:
            return None     # no gradient anywhere: None is the truth
        if _torch_compat.called_from_zero_grad():
            state.forget_reduction()    # it sets the gradient to None or zeroes it
            return pending[0]
        reduce = gradient_reducer(self)
        if reduce is not None:
            reduce()        # the optimizer averages every gradient it holds (see the module docstring)
            if state.grad_is_exact():
                return raw_grad(self)
            reduced = state.reduced_gradient()
            if reduced is not None:
                return reduced
        raise GradientNotGatheredError(
            f"zerocompile: `.grad` of parameter '{state.name}' (stage {state.stage}, {state.group.world} "
            f"ranks) is not the gradient a single process would have: {state.where_gradient_lives()}, "
            "and no zerocompile.ZeroOptimizer holds this parameter to average it. Build the optimizer "
            "over it (`zerocompile.ZeroOptimizer(model.parameters(), ...)`): then `p.grad` and "
            "torch.nn.utils.clip_grad_norm_ are exact, and `opt.clip_grad_norm_(max_norm)` clips too.")

    @grad.setter
    def grad(self, value):
        state = self.zero_state
        if value is None and state is not None:
            state.clear_gradients()
        set_raw_grad(self, value)


def _check_eager_use(param: ZeroParameter, func, args, kwargs):
    """Raise for a use of ``param`` that cannot be right; return a callable that performs a
    use zerocompile handles itself (``copy_`` into a freed parameter); None to run ``func``."""
    state = param.zero_state
    kind, name = _func_name(func)
    if name == "grad" and kind in ("get", "set"):
        return None     # the property above decides; the parameter's storage is not read
    if kind == "set":
        raise ParameterNotGatheredError(
            f"zerocompile: cannot set `.{name}` of parameter '{state.name}': zerocompile has sharded it "
            f"(stage {state.stage}), and the compiled graphs and the optimizer use its shards. Change "
            "parameters before the first compiled forward, or write values with `p.copy_(new_value)` / "
            "`model.load_state_dict(...)`.")
    if kind == "call" and name == "requires_grad_":
        raise ParameterNotGatheredError(
            f"zerocompile: cannot change requires_grad of parameter '{state.name}' after zerocompile "
            "sharded it; freeze parameters before the first compiled forward.")
    if kind == "call" and name == "copy_" and args and args[0] is param and len(args) >= 2 \
            and isinstance(args[1], DTensor):
        return lambda: _copy_from_dtensor(param, args[1])
    if not state.values_freed():
        return None
    if (kind == "get" and name in _METADATA_ATTRIBUTES) or (kind == "call" and name in _METADATA_METHODS):
        return None
    if kind == "call" and name in _LIKE_FACTORIES:
        return None     # a new tensor of the parameter's shape (torch's _init_optim_state: zeros_like)
    if kind == "call" and name == "copy_" and args and args[0] is param and len(args) >= 2:
        return lambda: _copy_into_shards(param, args[1])
    if kind == "call" and name == "detach" and _torch_compat.called_from_module_state_dict():
        saver = _save_pretrained_caller()
        if saver is not None:
            raise ParameterNotGatheredError(
                f"zerocompile: {saver}.save_pretrained(...) reads model.state_dict(), where parameter "
                f"'{state.name}' is this rank's shard (stage {state.stage}, {state.group.world} ranks), so it would "
                "save shards or fail. On every rank, either call zerocompile.save_pretrained(model, directory) "
                "(the full model in Hugging Face's layout, written by rank 0, gathered one tensor at a time), or "
                "pass the full values: model.save_pretrained(directory, state_dict=zerocompile.full_state_dict("
                "model), is_main_process=rank == 0) (a PEFT model saves its adapter from them); with Accelerate, "
                "ZeroAccelerator.save_model(model, directory) / get_state_dict(model).")
        return state.state_dict_value      # model.state_dict(): the sharded value
    if state.eager_regions is not None and state.eager_regions.borrow(state):
        return None     # used inside an eager module forward that does not own it: gathered for it
    what = f"`.{name}`" if kind == "get" else f"`{name}`"
    raise ParameterNotGatheredError(
        f"zerocompile: {what} on parameter '{state.name}' {tuple(param.shape)}, whose storage is freed "
        f"(stage {state.stage}: its values live in shards across {state.group.world} rank(s)). "
        + _HOW_TO_READ)


def _save_pretrained_caller(depth: int = 12) -> str | None:
    """The class of the module whose ``save_pretrained`` method (Hugging Face transformers',
    PEFT's) called ``model.state_dict()``, within ``depth`` frames; None if none did. Those save
    what ``state_dict()`` returns as whole tensors, which a sharded value is not."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "save_pretrained" else None
        if isinstance(owner, torch.nn.Module):
            return type(owner).__name__
        frame = frame.f_back
    return None


def _copy_into_shards(param: ZeroParameter, source) -> ZeroParameter:
    """``param.copy_(source)`` for a freed parameter: write this rank's chunk of the new value."""
    state = param.zero_state
    if torch.is_grad_enabled() and param.requires_grad:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation "
            f"(parameter '{state.name}'); wrap the write in `with torch.no_grad():`")
    source = torch.as_tensor(source, device=state.device)
    with _torch_compat.plain_tensor_ops():
        state.write_full(source.expand(state.shape))
    return param


def _copy_from_dtensor(param: ZeroParameter, source: DTensor) -> ZeroParameter:
    """``param.copy_(dtensor)`` (``load_state_dict`` of a state dict with sharded values). Where
    ``source`` holds exactly this rank's elements of the parameter (a value ``model.state_dict()``
    gave, loaded in place by ``dcp.load``), they are written into the shard; any other DTensor
    is gathered whole (``full_tensor()``, a collective) and written as a full value."""
    state = param.zero_state
    if torch.is_grad_enabled() and param.requires_grad:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation "
            f"(parameter '{state.name}'); wrap the write in `with torch.no_grad():`")
    if tuple(source.shape) != state.shape:
        raise RuntimeError(f"zerocompile: copy_ of a value of shape {tuple(source.shape)} into parameter "
                           f"'{state.name}' of shape {state.shape}")
    view = local_part(source)
    if view is None:
        full = source.full_tensor()
        with _torch_compat.plain_tensor_ops():
            state.write_full(full)
        return param
    start, stop = state.own_range() if state.rules.shards_master else (0, state.numel)
    if (view.start, view.start + view.flat.numel()) != (start, stop):
        raise ValueError(
            f"zerocompile: the value loaded into parameter '{state.name}' holds its elements "
            f"[{view.start}, {view.start + view.flat.numel()}), but this rank (rank {state.group.rank} of "
            f"{state.group.world}, stage {state.stage}) holds [{start}, {stop}): a sharded value loads only "
            "into the layout it was taken from. Load checkpoints through torch.distributed.checkpoint: "
            "dcp.load into get_model_state_dict(model) (or model.state_dict()) of this model, which "
            "reshards, then set_model_state_dict / load_state_dict")
    with _torch_compat.plain_tensor_ops():
        if state.rules.shards_master:
            state.write_own_elements(view.flat)
        else:
            state.write_full(view.flat.view(state.shape))
    return param


def adopt(param: torch.nn.Parameter) -> None:
    """Make ``param`` a ``ZeroParameter`` in place (same object, same data)."""
    if type(param) is torch.nn.Parameter:
        param.__class__ = ZeroParameter
    elif _torch_compat.is_fake_tensor(param):
        return      # a fake parameter (``zerocompile plan``) has no values to guard and keeps its class
    elif not isinstance(param, ZeroParameter):
        raise TypeError(
            f"zerocompile: parameters of class {type(param).__name__} (a subclass of nn.Parameter) "
            "cannot be sharded; use plain nn.Parameter")


def gradient_reducer(param: torch.Tensor):
    """What a read of ``param.grad`` calls first: the gradient reduction of the ``ZeroOptimizer``
    that steps ``param`` (``PROCESS.optimizer_of``), or None where none does."""
    optimizer = PROCESS.optimizer_of(param)
    return None if optimizer is None else optimizer.read_gradients
