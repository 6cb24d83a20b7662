"""Small models for the tests, each exercising one thing the backend must handle."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Two layers with sizes not divisible by 2 or 4 (uneven shards, padding)."""

    def __init__(self, d_in=7, d_hidden=13, d_out=5):
        super().__init__()
        self.l1 = nn.Linear(d_in, d_hidden)
        self.l2 = nn.Linear(d_hidden, d_out)

    def forward(self, x, y):
        return F.mse_loss(self.l2(torch.tanh(self.l1(x))), y)


class TiedLM(nn.Module):
    """Token embedding tied to the LM head, a LayerNorm, a buffer, and a graph break
    between the body and the head, so the tied weight is used by two frames."""

    def __init__(self, vocab=37, d=24, graph_break=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.graph_break = graph_break

    def forward(self, idx, targets):
        h = self.wte(idx)
        h = h + self.body(h) * self.scale
        if self.graph_break:
            torch._dynamo.graph_break()
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class EagerHead(nn.Linear):
    """A head Dynamo never compiles: its forward runs eagerly, in a graph break."""

    @torch.compiler.disable
    def forward(self, x):
        return super().forward(x)


class EagerHeadLM(TiedLM):
    """TiedLM whose head (tied to the compiled embedding) runs eagerly."""

    def __init__(self):
        super().__init__(graph_break=False)
        self.head = EagerHead(self.wte.embedding_dim, self.wte.num_embeddings, bias=False)
        self.head.weight = self.wte.weight


class FrozenMLP(MLP):
    """An MLP whose first layer's weight is frozen."""

    def __init__(self):
        super().__init__()
        self.l1.weight.requires_grad_(False)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # no bias: the key bias has an exactly-zero gradient (softmax is shift-invariant),
        # so Adam would turn pure rounding noise into updates
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT with a tied LM head (the memory and communication tests use it)."""

    def __init__(self, vocab=96, d=64, layers=2, heads=4, seq=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(model_name: str, step: int, batch: int):
    """Deterministic global batch for ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    if model_name in ("mlp", "frozen"):
        return torch.randn(batch, 7, generator=g), torch.randn(batch, 5, generator=g)
    if model_name in ("tied", "eager_head"):
        return torch.randint(0, 37, (batch, 6), generator=g), torch.randint(0, 37, (batch, 6), generator=g)
    return torch.randint(0, 96, (batch, 16), generator=g), torch.randint(0, 96, (batch, 16), generator=g)


def make_model(model_name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "tied": TiedLM, "frozen": FrozenMLP, "gpt": GPT, "eager_head": EagerHeadLM}[model_name]()
