"""Parameters used by code Dynamo leaves to eager are sharded like the rest (issue 45).

Each case trains on gloo ranks against one process on the whole batch (SGD with momentum;
every parameter on every rank compared) and checks what is sharded:

- a GPT whose block loop has a graph break (Dynamo gives up on the model's forward, so the
  embedding, positional table, final norm and tied head run eagerly), with a frozen
  positional table, in nanoGPT's loop: two micro-batches, torch's ``clip_grad_norm_``; stages
  0-3;
- the same GPT compiled per block (torchtitan's ``blk.compile(...)``) with an eager root, and
  with one block ``torch.compiler.disable``d (its parameters kept whole: ``keep_full``); the
  graph-break GPT at stage 3 on 3 ranks too (this file's one 3-rank case: padded shards);
- the per-block GPT with an untied head: its gradient is reduced when the head's backward ends
  (from the second backward on), not at the end of the backward; on 3 ranks too;
- a mixture of experts over 4 layers, each a leaf module (``set_leaf_modules``): exact, and
  while the backward runs the whole parameters alive are never more than one layer's;
- a parameter of an eager module that both ranks, then no rank, then one rank give a gradient:
  exact, and no gradient where no rank has one;
- PEFT LoRA on an HF Llama with and without gradient checkpointing: adapters exact, the frozen
  base sharded, the saved adapter the one-process adapter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocompile
from dist_utils import run_ranks
from harness import rank_slice
from models import GPT, make_batch
from zerocompile.runtime.raw_grad import raw_grad
from zerocompile.runtime.sharded_param import get_state

STEPS, ACCUM, BATCH = 2, 2, 12     # 12: the batch splits over 2 and 3 ranks; 2 steps: 4 backwards, the
                                   # second step on sharded parameters and learned hooks
SGD = {"lr": 0.1, "momentum": 0.9}
"""SGD: an update linear in the gradient, so a wrong gradient shows and rounding does not grow
(AdamW divides by the root of tiny second moments, which turns 1e-9 differences into 1e-4)."""


class BreakGPT(GPT):
    """``models.GPT`` with a graph break inside its block loop and a frozen positional table."""

    def __init__(self):
        super().__init__()
        self.wpe.weight.requires_grad_(False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class DisabledBlockGPT(GPT):
    """``models.GPT`` whose first block's forward is ``torch.compiler.disable``d."""

    def __init__(self):
        super().__init__()
        block = self.blocks[0]
        block.forward = torch.compiler.disable(block.forward)


class UntiedGPT(GPT):
    """``models.GPT`` with a head of its own (not tied to the embedding): a module whose
    gradient is reduced when its backward ends, before the backward of the rest."""

    def __init__(self):
        super().__init__()
        self.head.weight = nn.Parameter(self.head.weight.detach().clone())


def _gpt(kind: str) -> GPT:
    torch.manual_seed(0)
    return {"break": BreakGPT, "per_block": GPT, "disabled": DisabledBlockGPT, "untied": UntiedGPT}[kind]()


def _nanogpt_loop(model, opt, rank: int, world: int) -> list:
    """nanoGPT's step: accumulate ``ACCUM`` micro-batches, clip with torch's clip_grad_norm_."""
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = make_batch("gpt", step * ACCUM + micro, BATCH)
            (model(rank_slice(x, rank, world), rank_slice(y, rank, world)) / ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _reference(kind: str) -> dict:
    model = _gpt(kind)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], **SGD)
    norms = _nanogpt_loop(model, opt, 0, 1)
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train_gpt(rank: int, world: int, kind: str, stage: int) -> dict:
    torch._dynamo.reset()
    model = _gpt(kind)
    options = {"stage": stage, "inner_compiler": "eager"}
    if kind == "break":
        run = torch.compile(model, backend="zero", options=options)
    else:       # torchtitan's regional compilation: each block compiled, the root eager
        for block in model.blocks:
            block.compile(backend="zero", options=options)
        run = model
    opt = zerocompile.ZeroOptimizer([p for p in model.parameters() if p.requires_grad],
                                    optimizer_class=torch.optim.SGD, **SGD)
    head_grad_at_embedding = []
    if kind == "untied":
        # the embedding's gradient comes last in the backward: is the head's full gradient still alive?
        model.wte.weight.register_post_accumulate_grad_hook(
            lambda p: head_grad_at_embedding.append(raw_grad(model.head.weight) is not None))
    norms = _nanogpt_loop(run, opt, rank, world)
    states = {n: get_state(p) for n, p in model.named_parameters(remove_duplicate=False)}
    return {"norms": norms, "state": zerocompile.full_state_dict(model, rank0_only=False),
            "unsharded": sorted(n for n, sp in states.items() if sp is None),
            "whole": sorted(n for n, sp in states.items() if sp is not None and not sp.values_freed()),
            "stages": sorted({sp.stage for sp in states.values() if sp is not None}),
            "keep_full": sorted(n for n, sp in states.items() if sp is not None and sp.keep_full),
            "head_grad_at_embedding": head_grad_at_embedding}


def _gpt_runs(rank: int, world: int, cases) -> dict:
    return {case: _train_gpt(rank, world, *case) for case in cases}


def _assert_exact(result: dict, ref: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), atol=1e-5, rtol=1e-5)
    assert set(result["state"]) == set(ref["state"]), what
    for key, value in ref["state"].items():
        torch.testing.assert_close(result["state"][key], value, atol=2e-5, rtol=1e-5,
                                   msg=lambda m: f"{what}, {key}: {m}")


def _assert_sharded(result: dict, stage: int, what: str, keep_full=()) -> None:
    assert result["unsharded"] == [], f"{what}: parameters with no shard state: {result['unsharded']}"
    assert result["stages"] == [stage], what
    assert result["keep_full"] == sorted(keep_full), what
    if stage == 3:      # between steps only the shards are alive (and what is kept whole on purpose)
        assert result["whole"] == sorted(keep_full), f"{what}: whole after the step: {result['whole']}"


GPT_CASES = [("break", 0), ("break", 1), ("break", 2), ("break", 3), ("per_block", 0), ("per_block", 1),
             ("per_block", 2), ("per_block", 3), ("disabled", 3), ("untied", 3)]


@pytest.fixture(scope="module")
def gpt_runs(once_per_run):
    def compute():
        per_rank = run_ranks(_gpt_runs, 2, GPT_CASES)
        refs = {kind: _reference(kind) for kind in ("break", "per_block", "disabled", "untied")}
        return per_rank, refs
    return once_per_run("test_eager_regions.gpt_runs", compute)


@pytest.mark.parametrize("case", GPT_CASES, ids=[f"{k}-stage{s}" for k, s in GPT_CASES])
def test_gpt_with_eager_parts_is_exact_and_sharded(gpt_runs, case):
    """Every rank: the clipped norms and the parameters one process has, and every parameter
    (the eager embedding, final norm, tied head, the frozen positional table) sharded."""
    per_rank, refs = gpt_runs
    kind, stage = case
    # the disabled block's forward runs inside its compiled frame's graph break, where no module
    # hook runs: its parameters are kept whole (keep_full), the rest sharded
    keep_full = [f"blocks.0.{n}" for n, _ in _gpt(kind).blocks[0].named_parameters()] if kind == "disabled" else []
    for rank, results in enumerate(per_rank):
        what = f"{kind} at stage {stage}, rank {rank}"
        _assert_exact(results[case], refs[kind], what)
        _assert_sharded(results[case], stage, what, keep_full)
        if kind == "untied":
            # the first backward learns which modules have their gradients when their backward
            # ends; from the second on, the head's is reduced then, not at the end of the backward
            assert results[case]["head_grad_at_embedding"][:1] == [True], what
            assert results[case]["head_grad_at_embedding"][1:] == [False] * (STEPS * ACCUM - 1), what


def test_gpt_with_eager_parts_on_three_ranks_is_exact_and_sharded(gpt_runs):
    """The graph-break GPT (eager embedding, final norm and tied head) and the per-block compiled
    one with an untied head (its gradient reduced when its backward ends) at stage 3 on 3 ranks
    (parameters whose sizes do not divide by 3 are padded), in one group of ranks, against the
    one-process references the 2-rank cases use. This file's one 3-rank case: the disabled
    block's parameters are kept whole (nothing to pad), its other blocks compiled as the untied
    GPT's are, and the leaf-module and LoRA tests run on 2 ranks."""
    cases = [("break", 3), ("untied", 3)]
    per_rank = run_ranks(_gpt_runs, 3, cases)
    _, refs = gpt_runs
    for kind, stage in cases:
        for rank, results in enumerate(per_rank):
            _assert_exact(results[(kind, stage)], refs[kind], f"{kind}, 3 ranks, rank {rank}")
            _assert_sharded(results[(kind, stage)], stage, f"{kind}, 3 ranks, rank {rank}")
            if kind == "untied":
                assert results[(kind, stage)]["head_grad_at_embedding"][1:] == [False] * (STEPS * ACCUM - 1)


def _census_after_step(rank: int, world: int, kind: str) -> dict:
    """Live bytes after ``step()`` (AdamW, 2 steps) of the GPT with eager parts at stage 3, by an
    independent census of storages, with the frozen positional table's element count."""
    import gc

    from census import StorageCensus

    census = StorageCensus()
    with census:
        torch._dynamo.reset()
        model = _gpt(kind)
        options = {"stage": 3, "inner_compiler": "eager"}
        if kind == "break":
            run = torch.compile(model, backend="zero", options=options)
        else:
            for block in model.blocks:
                block.compile(backend="zero", options=options)
            run = model
        trainable = [p for p in model.parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        opt = zerocompile.ZeroOptimizer(trainable, optimizer_class=torch.optim.AdamW, lr=1e-3)
        for step in range(2):
            x, y = make_batch("gpt", step, BATCH)
            loss = run(rank_slice(x, rank, world), rank_slice(y, rank, world))
            loss.backward()
            opt.step()
            del x, y, loss
            gc.collect()
            live = census.settled_live_bytes()
            opt.zero_grad()
    return {"live": live, "trainable": [p.numel() for p in trainable], "frozen": [p.numel() for p in frozen]}


def _censuses_after_step(rank: int, world: int, kinds) -> dict:
    return {kind: _census_after_step(rank, world, kind) for kind in kinds}


@pytest.fixture(scope="module")
def censuses(once_per_run):
    """Both models' censuses in one group of 2 ranks (one after the other, each its own census)."""
    return once_per_run("test_eager_regions.censuses",
                        lambda: run_ranks(_censuses_after_step, 2, ("break", "untied")))


@pytest.mark.parametrize("kind", ["break", "untied"])
def test_stage3_memory_after_a_step_is_the_formula_with_eager_parts(censuses, kind):
    """After ``step()`` every rank holds 16 bytes per trainable element / N (the fp32 shard, its
    gradient and AdamW's two moments) and 4 per frozen element / N (its shard), within padding:
    the eager embedding, positional table (frozen), final norm and head too."""
    world = 2
    for rank, res in enumerate(r[kind] for r in censuses):
        sizes = res["trainable"] + res["frozen"]
        low = (16 * sum(res["trainable"]) + 4 * sum(res["frozen"])) / world
        high = (16 * sum(-(-n // world) * world for n in res["trainable"])
                + 4 * sum(-(-n // world) * world for n in res["frozen"])) / world + 8 * len(sizes) + 4096
        assert low <= res["live"] <= high, (kind, rank, res["live"], low, high)


def test_no_eager_run_outlives_its_step():
    """The root's run that began before its hooks existed (the step that compiled the blocks)
    ends with that step's backward: after the steps no eager run is open, so a read of a freed
    parameter outside any forward is refused, not gathered on behalf of a finished run and kept
    whole (which it was, before)."""
    from zerocompile.errors import ParameterNotGatheredError

    torch._dynamo.reset()
    model = _gpt("per_block")
    for block in model.blocks:
        block.compile(backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, **SGD)
    for step in range(2):
        model(*make_batch("gpt", step, 4)).backward()
        opt.step()
        opt.zero_grad()
        assert model._zerocompile_eager_regions.active == [], step
    with pytest.raises(ParameterNotGatheredError, match="ln_f.weight"), torch.no_grad():
        model.ln_f.weight.sum()
    assert get_state(model.ln_f.weight).values_freed()


# -- leaf modules: at most the leaves in use are whole -----------------------------------------
D, E, H, LAYERS = 8, 4, 32, 4


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D)) for _ in range(E))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            sel = (choice == i).nonzero().squeeze(-1)
            if sel.numel():
                out[sel] += probs[sel, i:i + 1] * expert(x[sel])
        return x + out


class Layer(nn.Module):
    """A transformer-like layer: a norm and projection Dynamo compiles, then the MoE leaf."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.moe = MoE()

    def forward(self, x):
        return self.moe(x + self.proj(self.norm(x)))


class MoENet(nn.Module):
    """The layer loop breaks at every leaf call, so Dynamo runs this forward eagerly (``inp`` and
    ``head`` with it) and compiles each layer's norm and projection as frames."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(x), y)


def _moe_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(12, D, generator=g), torch.randn(12, 3, generator=g)     # 12: splits over 2 and 3 ranks


def _moe_reference() -> dict:
    torch.manual_seed(0)
    model = MoENet()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    for step in range(STEPS):
        model(*_moe_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_moe(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MoENet()
    assert len(zerocompile.set_leaf_modules(model, [MoE])) == LAYERS
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, **SGD)
    whole_in_backward = []

    def whole_bytes(param):
        whole_in_backward.append(sum(p.untyped_storage().nbytes() for p in model.parameters()))

    for step in range(STEPS):
        if step == 1:       # the first step shards them: watch the later ones
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(whole_bytes)
        x, y = _moe_batch(step)
        compiled(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    layer_bytes = sum(p.numel() * p.element_size() for p in model.layers[0].moe.parameters())
    return {"state": zerocompile.full_state_dict(model, rank0_only=False), "layer_bytes": layer_bytes,
            "whole_in_backward": whole_in_backward,
            "whole_after": sum(p.untyped_storage().nbytes() for p in model.parameters())}


def test_leaf_modules_are_whole_only_while_they_run():
    """Four MoE layers as leaf modules at stage 3: exact, and during the backward the whole
    parameters alive never exceed one layer's (DeepSpeed frees a leaf after its forward and
    gathers it again for its backward; before, every leaf stayed whole until the step). On 2
    ranks (padding on 3 ranks: test_gpt_with_eager_parts_on_three_ranks_is_exact_and_sharded)."""
    ref = _moe_reference()
    for rank, result in enumerate(run_ranks(_train_moe, 2)):
        for key, value in ref.items():
            torch.testing.assert_close(result["state"][key], value, atol=2e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
        assert result["whole_in_backward"], "the leaves' gradients were never accumulated"
        assert max(result["whole_in_backward"]) <= result["layer_bytes"], (rank, result["whole_in_backward"])
        assert max(result["whole_in_backward"]) > 0, "a leaf's backward must run on its gathered parameters"
        assert result["whole_after"] == 0


# -- PEFT LoRA on an HF Llama: the frozen base sharded, the adapters exact -----------------------
LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LORA_IDS = torch.randint(0, 128, (STEPS, 6, 8), generator=torch.Generator().manual_seed(1))


# -- a parameter some ranks' code uses, then none --------------------------------------------
class Gate(nn.Module):
    """An eager module whose own parameter ``extra`` gets a gradient when ``use_extra`` says so."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(D, D)
        self.extra = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x, use_extra: bool):
        # the same ops either way (every rank gathers in the same order); detached, no gradient
        return self.scale(x) * (self.extra if use_extra else self.extra.detach())


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class GateNet(nn.Module):
    """``inp`` and ``gate`` eager, ``body`` compiled on its own (``body.compile``; a module of the
    user's class: Dynamo does not trace ``nn.Sequential.forward`` as a frame of its own)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.gate = Gate()
        self.body = Body()
        self.head = nn.Linear(D, 3)

    def forward(self, x, y, use_extra: bool):
        return F.mse_loss(self.head(self.body(self.gate(self.inp(x), use_extra))), y)


GATE_USE = [[True, True], [True, True], [False, False], [True, True], [True, False]]
"""Per step, whether each of 2 ranks' forward uses ``gate.extra``. The first step installs the
hooks in its forward; in the second every rank has the gradient when the gate's backward ends,
so the third reduces it then: no rank has one there, so every rank sends zeros, and the
parameter must end with no gradient, as in one process. The fourth learns again; in the fifth,
rank 0 only has one (rank 1 sends zeros when the gate's backward ends)."""


def _gate_reference() -> dict:
    """One process: each step's loss is the mean of the ranks' losses, each with its rank's
    ``use_extra`` (what averaging the ranks' gradients computes)."""
    torch.manual_seed(0)
    model = GateNet()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    grads = []
    for step, use in enumerate(GATE_USE):
        x, y = _moe_batch(step)
        loss = sum(model(rank_slice(x, r, 2), rank_slice(y, r, 2), use[r]) for r in range(2)) / 2
        loss.backward()
        grads.append(model.gate.extra.grad is not None)
        opt.step()
        opt.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "extra_has_grad": grads}


def _train_gate(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GateNet()
    model.body.compile(backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, **SGD)
    grads, eligible = [], []
    for step, use in enumerate(GATE_USE):
        x, y = _moe_batch(step)
        model(rank_slice(x, rank, world), rank_slice(y, rank, world), use[rank]).backward()
        grads.append(model.gate.extra.grad is not None)
        # whether the next backward reduces it when the gate's backward ends
        regions = model._zerocompile_eager_regions
        eligible.append(id(get_state(model.gate.extra)) in regions.grads.eligible)
        opt.step()
        opt.zero_grad()
    return {"state": zerocompile.full_state_dict(model, rank0_only=False), "extra_has_grad": grads,
            "eligible": eligible}


def test_a_parameter_used_by_some_ranks_then_by_none_matches_one_process():
    """A module's own parameter reduced when the module's backward ends: exact where only some
    ranks used it (the others send zeros), and no gradient at all where no rank did (SGD with
    momentum would otherwise move it)."""
    ref = _gate_reference()
    assert ref["extra_has_grad"] == [True, True, False, True, True]
    for rank, result in enumerate(run_ranks(_train_gate, 2)):
        assert result["extra_has_grad"] == ref["extra_has_grad"], f"rank {rank}"
        # reduced when the gate's backward ends in the third and fifth steps
        assert result["eligible"] == [False, True, False, True, False], f"rank {rank}"
        for key, value in ref["state"].items():
            torch.testing.assert_close(result["state"][key], value, atol=2e-6, rtol=1e-5,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")


def _lora_llama(checkpointing: bool):
    """transformers #47254's setup: with checkpointing, enable_input_require_grads() registers a
    forward hook on the embedding that Dynamo cannot trace, so the embedding runs eagerly."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, use_cache=not checkpointing))
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config).train()


def _lora_reference(checkpointing: bool) -> dict:
    model = _lora_llama(checkpointing)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], **SGD)
    for ids in LORA_IDS:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"adapters": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "adapter_file": _reference_adapter(model)}


def _lora_runs(rank: int, world: int, cases) -> dict:
    out = {}
    for checkpointing, stage in cases:
        torch._dynamo.reset()
        model = _lora_llama(checkpointing)
        compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
        opt = zerocompile.ZeroOptimizer([p for p in model.parameters() if p.requires_grad],
                                        optimizer_class=torch.optim.SGD, **SGD)
        for ids in LORA_IDS:
            mine = rank_slice(ids, rank, world)
            compiled(input_ids=mine, labels=mine).loss.backward()
            opt.step()
            opt.zero_grad()
        full = zerocompile.full_state_dict(model, rank0_only=False)
        states = {n: get_state(p) for n, p in model.named_parameters()}
        saved = _save_adapter(model, rank, stage)
        frozen = [sp for n, sp in states.items() if sp is not None and not sp.requires_grad]
        out[(checkpointing, stage)] = {
            "adapters": {n: full[n] for n, p in model.named_parameters() if p.requires_grad},
            "unsharded": sorted(n for n, sp in states.items() if sp is None),
            "whole": sorted(n for n, sp in states.items() if sp is not None and not sp.values_freed()),
            "frozen_one_nth": sum(-(-p.numel() // world) for p in model.parameters() if not p.requires_grad),
            "frozen_shard_elements": sum(sp.shard.numel() for sp in frozen if sp.shard is not None),
            **saved}
    return out


def _save_adapter(model, rank: int, stage: int) -> dict:
    """PEFT's save_pretrained: as such at stage 3 it refuses (it would read the shards), naming the
    call to use; with the full values (zerocompile.full_state_dict) rank 0 writes the adapter."""
    import tempfile

    from safetensors.torch import load_file

    out = {}
    directory = tempfile.mkdtemp()
    if stage == 3:
        try:
            model.save_pretrained(directory)
            out["plain_save"] = "saved"
        except Exception as err:     # noqa: BLE001  (the test reads what it says)
            out["plain_save"] = str(err)
    model.save_pretrained(directory, state_dict=zerocompile.full_state_dict(model), is_main_process=rank == 0)
    if rank == 0:
        out["adapter_file"] = load_file(f"{directory}/adapter_model.safetensors")
    return out


def _reference_adapter(model) -> dict:
    import tempfile

    from safetensors.torch import load_file

    directory = tempfile.mkdtemp()
    model.save_pretrained(directory)
    return load_file(f"{directory}/adapter_model.safetensors")


LORA_CASES = [(True, 3), (False, 3), (True, 1)]


def test_peft_lora_adapters_are_exact_and_the_frozen_base_is_sharded():
    """PEFT LoRA on an HF Llama, with and without gradient checkpointing +
    enable_input_require_grads (the eager embedding): the adapters equal one process's on
    every rank, and every base parameter, the frozen embedding included, has a shard state; at
    stage 3 none is whole after a step and the frozen parameters hold 1/N of their elements.
    The saved adapter (save_pretrained with zerocompile.full_state_dict) is the file one process
    writes; save_pretrained alone at stage 3 refuses, naming the calls to use."""
    runs = [(2, rank, results) for rank, results in enumerate(run_ranks(_lora_runs, 2, LORA_CASES))]
    refs = {ckpt: _lora_reference(ckpt) for ckpt in (True, False)}
    for world, rank, results in runs:
        for (checkpointing, stage), result in results.items():
            what = f"checkpointing={checkpointing}, stage {stage}, rank {rank} of {world}"
            assert result["unsharded"] == [], what
            for name, value in refs[checkpointing]["adapters"].items():
                torch.testing.assert_close(result["adapters"][name], value, atol=2e-5, rtol=1e-5,
                                           msg=lambda m: f"{what}, {name}: {m}")
            if stage == 3:
                assert result["whole"] == [], f"{what}: whole after the step: {result['whole']}"
                # each frozen parameter's shard holds ceil(numel / N) elements, nothing more
                assert result["frozen_shard_elements"] == result["frozen_one_nth"], what
                assert "zerocompile.save_pretrained(model, directory)" in result["plain_save"], result["plain_save"]
                assert "PeftModel.save_pretrained" in result["plain_save"], result["plain_save"]
            if rank == 0:       # the adapter file one process would write
                want = refs[checkpointing]["adapter_file"]
                assert sorted(result["adapter_file"]) == sorted(want), what
                for key, value in want.items():
                    torch.testing.assert_close(result["adapter_file"][key], value, atol=2e-5, rtol=1e-5)
