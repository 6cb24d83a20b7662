"""The ``.grad`` autograd keeps on a tensor itself, read and written past ``ZeroParameter``'s
``grad`` property (``runtime/zero_parameter.py``): zerocompile's own code uses these where it
holds or moves gradients, the property is what users see."""

from __future__ import annotations

import torch

from zerocompile import _torch_compat

__all__ = ["raw_grad", "raw_grads", "set_raw_grad"]


def raw_grad(param: torch.Tensor):
    """The ``.grad`` autograd keeps on ``param`` itself, without ``ZeroParameter``'s check.

    Outside ``ZeroParameter.__torch_function__``, which lets ``.grad`` through unchanged but
    costs about 20 us per call in its scan of the arguments: the optimizer step reads every
    parameter's gradient (40 ms a step for 1000 parameters)."""
    with _torch_compat.plain_tensor_ops():
        return torch.Tensor.grad.__get__(param)


def raw_grads(params: list) -> list:
    """``[raw_grad(p) for p in params]``, in one ``plain_tensor_ops`` context and with no Python
    call per parameter (an optimizer step reads them all)."""
    with _torch_compat.plain_tensor_ops():
        return list(map(torch.Tensor.grad.__get__, params))


def set_raw_grad(param: torch.Tensor, value) -> None:
    """Set the ``.grad`` autograd keeps on ``param`` itself (past ``ZeroParameter``'s check)."""
    with _torch_compat.plain_tensor_ops():
        torch.Tensor.grad.__set__(param, value)
