"""A small GPT-like language model and a fixed cost model for the micro-benchmarks.

The benchmarks only need a model whose FX graph grows linearly with a ``layers``
argument and that looks like a real transformer (embeddings tied to the head, layer
norms, attention, an MLP), so that the pass pipeline sees realistic graphs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 128
SEQ = 16

# Passed as the ``cost_model`` option so that compiling never runs the cost-model probe
# (which times real collectives and matmuls and would add noise to a compile-time measurement).
FIXED_COST_MODEL = {"flops_per_s": 1e12, "alpha_us": 10.0, "bandwidth_gbps": 10.0, "memory_gbps": 100.0}


class TransformerBlock(nn.Module):
    """Pre-norm block: causal self-attention, then a 4x MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_attn = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.mlp_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        head_dim = dim // self.heads
        q, k, v = self.qkv(self.norm_attn(x)).split(dim, dim=2)
        q = q.view(batch, seq, self.heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.heads, head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm_mlp(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a head tied
    to the token embedding; ``forward(idx, targets)`` returns the cross-entropy loss."""

    def __init__(self, layers: int, dim: int = 64, heads: int = 4):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, dim)
        self.pos_emb = nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_batch(batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of token ids and targets of shape ``(batch, SEQ)``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return idx, targets
