"""A small GPT-like language model and a fixed cost model for the micro-benchmarks.

The benchmarks need a model whose FX graph grows linearly with a ``layers`` argument and
that looks like a real transformer: the demo GPT of ``examples/train_gpt.py``, loaded by
``benchmarks/common.py`` as the other benchmarks load it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import load_example  # noqa: E402

VOCAB = 128
SEQ = 16

# Passed as the ``cost_model`` option so that compiling never runs the cost-model probe
# (which times real collectives and matmuls and would add noise to a compile-time measurement).
FIXED_COST_MODEL = {"flops_per_s": 1e12, "alpha_us": 10.0, "bandwidth_gbps": 10.0, "memory_gbps": 100.0}


def gpt(layers: int, dim: int = 64, heads: int = 4) -> torch.nn.Module:
    """The GPT of ``examples/train_gpt.py`` (tied head, pre-norm blocks, causal attention,
    a 4x MLP) with ``layers`` blocks; ``forward(idx, targets)`` returns the loss."""
    return load_example().GPT(vocab=VOCAB, seq_len=SEQ, d_model=dim, n_layers=layers, n_heads=heads)


def make_batch(batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of token ids and targets of shape ``(batch, SEQ)``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return idx, targets
