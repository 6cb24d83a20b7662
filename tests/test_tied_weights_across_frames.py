"""Tied weights used by several frames and by eager code between them (issue 25, point 2).

A tied-embedding HF Llama whose decoder-layer loop breaks in a forward hook: Dynamo gives up on
``LlamaModel.forward`` (it runs eagerly, the embedding with it), compiles each decoder layer, the
final norm and the LM head as frames of their own, and the head's frame shards the tied weight
that the eager embedding reads. A small tied model puts the head in eager code before or after the
frame that shards the weight, or in a frame before the embedding's. On 2 gloo ranks against one
process on the whole batch (the small models at every stage, the Llamas at stages 2-3, ``CASES``);
at stage 3 the tied weight ends each step sharded.
"""

from __future__ import annotations

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from zerocompile.runtime.sharded_param import get_state

transformers = pytest.importorskip("transformers")

STEPS, BATCH = 2, 4      # step 0 uses the weight before it is sharded, step 1 after
VOCAB, HIDDEN = 64, 16


def _break_before(module, args):
    torch._dynamo.graph_break()


def _break_after(module, args, output):
    torch._dynamo.graph_break()
    return output


@torch.compiler.disable
def _eagerly(module, x):
    return module(x)


class TiedHeadAndEmbedding(torch.nn.Module):
    """An embedding and an LM head sharing one weight, the head used in eager code (a
    ``torch.compiler.disable``d call) before or after the frame that embeds, or in a frame of its
    own before the embedding's frame."""

    def __init__(self, order: str):
        super().__init__()
        self.order = order
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids, feats):
        if self.order == "eager_head_first":
            logits = _eagerly(self.head, self.proj(feats))   # saves the weight for its backward
            h = self.embed(ids)
        elif self.order == "eager_head_last":
            h = self.embed(ids)
            logits = _eagerly(self.head, self.proj(feats))
        else:                                               # "head_frame_first"
            logits = self.head(self.proj(feats))
            torch._dynamo.graph_break()
            h = self.embed(ids)
        out = logits.log_softmax(-1)[..., 0].sum() + 0.01 * (h * h).sum() + self.head(h).logsumexp(-1).sum()
        return out / ids.shape[0]


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if not name.startswith("llama"):
        return TiedHeadAndEmbedding(name)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=True))
    if name == "llama_pre_hook":
        model.model.layers[1].register_forward_pre_hook(_break_before)
    else:
        for layer in model.model.layers:
            layer.register_forward_hook(_break_after)
    return model


# the stages each model runs at. An HF Llama compile costs ~8 s of CPU per rank: the Llamas run at
# stage 3 (the stage that failed) and the pre-hook one at stage 2 too (eager gradients beside
# gradients reduce-scattered in the backward); at stages 0-1 every gradient is reduced whole in
# the step, which the small tied models check at every stage
CASES = {"llama_pre_hook": (2, 3), "llama_post_hooks": (3,), "eager_head_first": (0, 1, 2, 3),
         "eager_head_last": (0, 1, 2, 3), "head_frame_first": (0, 1, 2, 3)}


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, 8), generator=g), torch.randn(BATCH, 8, HIDDEN, generator=g)


def loss_of(model, name, ids, feats):
    if name.startswith("llama"):
        return model(input_ids=ids, labels=ids).loss
    return model(ids, feats)


def make_optimizer(params, zero: bool):
    # SGD: Adam would scale the rounding of elements with a near-zero gradient up to lr-sized
    # updates (see test_third_party_models.py); the reference runs torch's fused kernel, whose
    # roundings ZeroOptimizer's SGD computes
    if zero:
        return zerocompile.ZeroOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)


def reference(name: str):
    model = build(name)
    opt = make_optimizer(model.parameters(), zero=False)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, name, *batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _runs(rank, world):
    out = {}
    per = BATCH // world
    for name, stages in CASES.items():
        for stage in stages:
            torch._dynamo.reset()
            model = build(name)
            compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
            opt = make_optimizer(compiled.parameters(), zero=True)
            losses = []
            for step in range(STEPS):
                ids, feats = (t[rank * per:(rank + 1) * per] for t in batch(step))
                loss = loss_of(compiled, name, ids, feats)
                loss.backward()
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                torch.distributed.all_reduce(total)
                losses.append(total.item() / world)
            freed = {n: get_state(p) is not None and get_state(p).values_freed()
                     for n, p in model.named_parameters()}
            out[(name, stage)] = {"losses": losses, "state": zerocompile.full_state_dict(compiled), "freed": freed}
    return out


@pytest.fixture(scope="module")
def runs(once_per_run):
    return once_per_run("test_tied_weights_across_frames.runs", lambda: run_ranks(_runs, 2))


@pytest.mark.parametrize("name", CASES)
def test_tied_weight_used_across_frames_and_eager_code_is_exact(runs, name):
    """Every rank: the global losses of one process; the full state dict (gathered on rank 0,
    empty elsewhere) its parameters; at stage 3 no parameter whole after the step."""
    ref_losses, ref_state = reference(name)
    for rank, ranks in enumerate(runs):
        for stage in CASES[name]:
            got = ranks[(name, stage)]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank} stage {stage}: {m}")
            if rank != 0:
                assert got["state"] == {}, (rank, stage, sorted(got["state"]))
                continue
            assert set(got["state"]) == set(ref_state)
            for key, value in ref_state.items():
                torch.testing.assert_close(got["state"][key], value, atol=2e-5, rtol=2e-5,
                                           msg=lambda m: f"stage {stage} {key}: {m}")
        # stage 3 shards every parameter, the tied one included: after the optimizer step no
        # rank holds any of them whole (exact because it is gathered where eager code uses it,
        # not kept)
        freed = ranks[(name, 3)]["freed"]
        assert freed and all(freed.values()), (rank, [n for n, f in freed.items() if not f])
