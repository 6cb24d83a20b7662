"""The ``.grad`` autograd keeps on a tensor itself, read and written past ``ZeroParameter``'s
``grad`` property (``runtime/zero_parameter.py``): zerocompile's own code uses these where it
holds or moves gradients, the property is what users see."""

from __future__ import annotations

import torch

__all__ = ["raw_grad", "set_raw_grad"]


def raw_grad(param: torch.Tensor):
    """The ``.grad`` autograd keeps on ``param`` itself, without ``ZeroParameter``'s check."""
    return torch.Tensor.grad.__get__(param)


def set_raw_grad(param: torch.Tensor, value) -> None:
    torch.Tensor.grad.__set__(param, value)
