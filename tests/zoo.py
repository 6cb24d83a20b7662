"""Models whose parameters reach compiled frames in ways that once confused zerocompile:
graph breaks inside layer loops (one compiled frame then runs for several blocks), forward
hooks that break graphs, a module called twice, parameters shared between blocks and frames,
a block that never compiles. Each takes ``(x, y)`` and returns a scalar loss."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

D = 8


class Residual(nn.Module):
    """``x + l(x)``: the block of the original report (issue 8, problem 1)."""

    def __init__(self, d=D):
        super().__init__()
        self.l = nn.Linear(d, d)

    def forward(self, x):
        return x + self.l(x)


class MLPBlock(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.ln(x))))


class EagerBlock(MLPBlock):
    """A block Dynamo never compiles."""

    @torch.compiler.disable
    def forward(self, x):
        return super().forward(x)


class LoopWithBreak(nn.Module):
    """Blocks in a loop, with a graph break at ``where``: "before" the first block, "between"
    blocks 0 and 1 (the original report), "after" the last, or after "every" block."""

    def __init__(self, where: str, n=4, block=Residual):
        super().__init__()
        self.where = where
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            if self.where == "before" and i == 0:
                torch._dynamo.graph_break()
            x = blk(x)
            if (self.where == "between" and i == 0) or (self.where == "after" and i == last) or self.where == "every":
                torch._dynamo.graph_break()
        return F.mse_loss(self.head(x), y)


class NestedLists(nn.Module):
    """Stages of blocks (ModuleList of ModuleLists), a break inside the inner loop."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(MLPBlock() for _ in range(2)) for _ in range(3))
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        for stage in self.stages:
            for j, blk in enumerate(stage):
                x = blk(x)
                if j == 0:
                    torch._dynamo.graph_break()
        return F.mse_loss(self.head(x), y)


def _breaking_hook(module, args, output):
    torch._dynamo.graph_break()
    return output


class HookBreaks(nn.Module):
    """A forward hook on every block that breaks the graph."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(3))
        for blk in self.blocks:
            blk.register_forward_hook(_breaking_hook)
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        for blk in self.blocks:
            x = blk(x)
        return F.mse_loss(self.head(x), y)


class CalledTwice(nn.Module):
    """One block called twice, with a graph break between the calls."""

    def __init__(self):
        super().__init__()
        self.first = MLPBlock()
        self.twice = MLPBlock()
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        x = self.twice(self.first(x))
        torch._dynamo.graph_break()
        x = self.twice(x)
        return F.mse_loss(self.head(x), y)


class SharedAcrossBlocks(nn.Module):
    """Blocks 0 and 2 share one Linear; the input projection is tied to the head; graph
    breaks between the blocks, so the shared parameters reach several frames."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, D, bias=False)
        self.blocks = nn.ModuleList(Residual() for _ in range(3))
        self.blocks[2].l = self.blocks[0].l
        self.head = nn.Linear(D, 3, bias=False)
        self.head.weight = nn.Parameter(self.inp.weight.t().contiguous().clone())

    def forward(self, x, y):
        x = self.inp(x[:, :3])
        for blk in self.blocks:
            x = blk(x)
            torch._dynamo.graph_break()
        return F.mse_loss(F.linear(x, self.inp.weight.t()) + self.head(x), y)


class ParamViewAcrossBreak(nn.Module):
    """A view of a parameter made before a graph break and used after it: the first frame
    returns a view of its parameter input (``weight.t()``), which the second frame consumes."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        w = self.l.weight.t()
        h = torch.tanh(self.l(x))
        torch._dynamo.graph_break()
        return F.mse_loss(self.head(h @ w), y)


class WithEagerBlock(nn.Module):
    """A ``torch.compiler.disable``d block in the middle of a loop of compiled ones."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(), EagerBlock(), MLPBlock(), MLPBlock()])
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        for blk in self.blocks:
            x = blk(x)
        return F.mse_loss(self.head(x), y)


ZOO = {
    "loop_break_before": lambda: LoopWithBreak("before"),
    "loop_break_between": lambda: LoopWithBreak("between"),
    "loop_break_after": lambda: LoopWithBreak("after"),
    "loop_break_every": lambda: LoopWithBreak("every", block=MLPBlock),
    "nested_lists": NestedLists,
    "hook_breaks": HookBreaks,
    "called_twice": CalledTwice,
    "shared_across_blocks": SharedAcrossBlocks,
    "eager_block": WithEagerBlock,
    "param_view_across_break": ParamViewAcrossBreak,
}


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ZOO[name]()


def batch(step: int, size: int = 4):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(size, D, generator=g), torch.randn(size, 3, generator=g)
