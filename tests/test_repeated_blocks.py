"""Deep models compile one block (``zerocompile/repeated_blocks.py``): a model compiled whole
whose identical layers compile once, exact against one process and against the same model
compiled as one graph (``repeated_blocks="off"``), on every rank: a GPT with a tied head at
stages 0-3, HF Llama with HF gradient checkpointing, a graph break inside the layer loop, and a
layer whose parameter differs (frozen) compiling apart."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

import zerocompile
import zoo
from dist_utils import run_ranks
from harness import Run, assert_matches, ranks_of, reference, runs_apart, train_on_rank_slices, zero_train
from zerocompile import repeated_blocks
from zerocompile.errors import ZeroConfigError
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.sharded_param import get_state


def _dynamo_graph(model, *args):
    """The one Dynamo graph of ``model(*args)`` and its example inputs (no compile)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*args)
    assert len(seen) == 1
    return seen[0]


def _gpt(layers=4):
    from models import GPT
    torch.manual_seed(0)
    return GPT(layers=layers)


def test_a_deep_frame_is_cut_where_its_layers_begin_and_end_and_the_layers_are_alike():
    model = _gpt(4)
    idx = torch.randint(0, 96, (2, 16))
    gm, examples = _dynamo_graph(model, idx, idx)
    assert repeated_blocks.block_container(gm, 5) is None                      # 4 blocks only
    container, cls = repeated_blocks.block_container(gm, 4)
    assert container.endswith(".blocks") and cls.endswith("Block'>")
    pieces = repeated_blocks.pieces_of(gm, container, cls)
    assert [p.block for p in pieces] == [None, 0, 1, 2, 3, None]
    # every graph node is in one piece, in graph order
    flat = [n for p in pieces for n in p.nodes]
    assert flat == [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    index = {n: i for i, n in enumerate(placeholders)}
    keys = []
    for piece in pieces:
        sub = repeated_blocks.piece_module(gm, piece)
        ex = [examples[index[v]] if v.op == "placeholder" else v.meta["example_value"] for v in piece.inputs]
        keys.append(repeated_blocks.structure_key(sub, ex))
        # each block reads its own parameters and the activation before it; the tied head reads wte
        if piece.block is not None:
            names = [v.name for v in piece.inputs if v.op == "placeholder"]
            assert all(f"blocks_modules_{piece.block}_" in name for name in names), names
    assert len(set(keys[1:5])) == 1 and keys[0] != keys[1] and keys[5] != keys[1]
    # a layer with a frozen weight is not like the others
    model.blocks[2].fc.weight.requires_grad_(False)
    gm, examples = _dynamo_graph(model, idx, idx)
    pieces = repeated_blocks.pieces_of(gm, container, cls)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    index = {n: i for i, n in enumerate(placeholders)}
    keys = [repeated_blocks.structure_key(
        repeated_blocks.piece_module(gm, p),
        [examples[index[v]] if v.op == "placeholder" else v.meta["example_value"] for v in p.inputs])
        for p in pieces[1:5]]
    assert keys[0] == keys[1] == keys[3] != keys[2]


@pytest.mark.parametrize("value", ["on", 1, 0, True, 2.5, None])
def test_bad_repeated_blocks_values_are_refused_with_the_allowed_ones(value):
    with pytest.raises(ZeroConfigError, match="repeated_blocks.*allowed: 'auto'"):
        zerocompile.ZeroConfig.from_options({"repeated_blocks": value})


def test_defaults_and_thresholds():
    assert zerocompile.ZeroConfig.from_options({}).compiler.repeated_blocks == "auto"
    assert repeated_blocks.min_blocks("auto") == repeated_blocks.AUTO_MIN_BLOCKS == 8
    assert repeated_blocks.min_blocks(3) == 3 and repeated_blocks.min_blocks("off") is None


def _gpt_runs(rank, world):
    """The tied GPT with 4 blocks at stages 0-3, compiled whole, blocks on and off."""
    out = {}
    for stage in (0, 1, 2, 3):
        for blocks in (2, "off"):
            run = Run(model="gpt", stage=stage, opt="sgd", steps=3, batch=4, options=(("repeated_blocks", blocks),))
            result = zero_train(rank, world, run)
            result["compiled_frames"] = len(result.pop("reports"))
            out[(stage, blocks)] = result
    return out


def _llama(checkpointing: str | None):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64, use_cache=False,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    return model


def _llama_batches(steps=3, batch=4):
    g = torch.Generator().manual_seed(7)
    return [(ids, ids) for ids in (torch.randint(0, 64, (batch, 12), generator=g) for _ in range(steps))]


def _causal_lm_loss(model):
    """``(ids, labels) -> loss`` of an HF causal LM, the call ``train_on_rank_slices`` makes."""
    return lambda ids, labels: model(input_ids=ids, labels=labels).loss


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _llama_reference(checkpointing):
    model = _llama(checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_on_rank_slices(_causal_lm_loss(model), opt, _llama_batches(), 0, 1)
    return {"losses": losses, "state": _state(model)}


def _llama_zero(rank, world, checkpointing, blocks, stage=3, param_dtype=None):
    torch._dynamo.reset()
    started = time.monotonic_ns()
    zerocompile.reset_stats()
    model = _llama(checkpointing)
    options = {"stage": stage, "inner_compiler": "eager", "repeated_blocks": blocks}
    if param_dtype is not None:
        options["param_dtype"] = param_dtype
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-2)
    losses = train_on_rank_slices(_causal_lm_loss(compiled), opt, _llama_batches(), rank, world)
    sessions = {id(r.session) for r in PROCESS.frames() if r.order > started}
    misnamed = [n for n, p in model.named_parameters() if not get_state(p).name.endswith(n)]
    return {"losses": losses, "state": zerocompile.full_state_dict(compiled), "misnamed": misnamed,
            "frames": len([r for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]),
            "sessions": len(sessions),
            "stats": {k: v for k, v in zerocompile.stats(compiled).as_dict().items() if k != "compile_seconds"}}


class _BreakBeforeLoop(torch.nn.Module):
    """Six identical blocks after a graph break: the frame Dynamo resumes in holds them all."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(zoo.MLPBlock() for _ in range(6))
        self.head = torch.nn.Linear(zoo.D, 3)

    def forward(self, x, y):
        x = x * 2
        torch._dynamo.graph_break()
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def _loop_model(where: str):
    torch.manual_seed(0)
    if where == "before":
        return _BreakBeforeLoop()
    return zoo.LoopWithBreak(where, n=6, block=zoo.MLPBlock)


def _loop_reference(where):
    model = _loop_model(where)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = train_on_rank_slices(model, opt, [zoo.batch(step) for step in range(3)], 0, 1)
    return {"losses": losses, "state": _state(model)}


def _loop_zero(rank, world, where, blocks):
    torch._dynamo.reset()
    started = time.monotonic_ns()
    model = _loop_model(where)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager",
                                                              "repeated_blocks": blocks})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    losses = train_on_rank_slices(compiled, opt, [zoo.batch(step) for step in range(3)], rank, world)
    return {"losses": losses, "state": zerocompile.full_state_dict(compiled),
            "frames": len([r for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]),
            "param_bytes": zerocompile.stats(compiled).param_bytes}


def _all_runs(rank, world):
    return runs_apart(rank, world, [
        ("gpt", _gpt_runs, ()),
        ("llama", _llama_zero, (None, 2)),
        ("llama_off", _llama_zero, (None, "off")),
        ("llama_ckpt", _llama_zero, ("non_reentrant", 2)),
        ("llama_ckpt_off", _llama_zero, ("non_reentrant", "off")),
        ("llama_reentrant", _llama_zero, ("reentrant", 2, 2)),
        ("llama_bf16_1", _llama_zero, (None, 2, 1, "bfloat16")),
        ("llama_bf16_1_off", _llama_zero, (None, "off", 1, "bfloat16")),
        ("llama_bf16_3", _llama_zero, (None, 2, 3, "bfloat16")),
        ("llama_bf16_3_off", _llama_zero, (None, "off", 3, "bfloat16")),
        ("llama_bf16_ckpt", _llama_zero, ("non_reentrant", 2, 3, "bfloat16")),
        ("llama_bf16_ckpt_off", _llama_zero, ("non_reentrant", "off", 3, "bfloat16")),
        ("before", _loop_zero, ("before", 2)),
        ("before_off", _loop_zero, ("before", "off")),
        ("between", _loop_zero, ("between", 2)),
        ("between_off", _loop_zero, ("between", "off")),
    ])


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_runs, 2)


def _same(a: dict, b: dict) -> None:
    """Bitwise equal losses and final state (the same ops run, eager inner compiler)."""
    assert a["losses"] == b["losses"]
    assert set(a["state"]) == set(b["state"])
    for key, value in b["state"].items():
        assert torch.equal(a["state"][key], value), key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tied_gpt_compiled_whole_block_by_block_is_exact_on_every_rank(results, stage):
    ref = reference(Run(model="gpt", stage=stage, opt="sgd", steps=3, batch=4))
    for rank, result in enumerate(ranks_of(results, "gpt")):
        blockwise, whole = result[(stage, 2)], result[(stage, "off")]
        if rank == 0:         # full_state_dict gathers to rank 0; the losses are every rank's
            assert_matches(blockwise, ref)
            # not bitwise: the tied weight's two gradients are summed by autograd across pieces,
            # in the graph when whole
            assert_matches(blockwise, whole, atol=1e-6, rtol=1e-6)
        else:
            torch.testing.assert_close(torch.tensor(blockwise["losses"]), torch.tensor(ref["losses"]))
        # one compile for the embedding, one for the four blocks, one for the tied head and loss
        assert (blockwise["compiled_frames"], whole["compiled_frames"]) == (3, 1)
        if stage == 3:
            # as one graph, but the tied weight, which two pieces use (the embedding's and the
            # head's), is gathered and its gradient reduce-scattered once more per step: by each
            tied = 96 * 64 * 4 * 3                 # vocab x d, fp32, 3 steps
            extra = blockwise["stats"]["reduce_scatter"]["bytes"] - whole["stats"]["reduce_scatter"]["bytes"]
            assert extra == tied, (extra, tied)
            extra = blockwise["stats"]["all_gather"]["bytes"] - whole["stats"]["all_gather"]["bytes"]
            assert tied <= extra <= tied * 1.01, (extra, tied)


@pytest.mark.parametrize("case,checkpointing", [("llama", None), ("llama_ckpt", "non_reentrant"),
                                                ("llama_reentrant", "reentrant")])
def test_hf_llama_compiled_whole_with_hf_checkpointing_is_exact_on_every_rank(results, case, checkpointing):
    ref = _llama_reference(checkpointing)
    for rank, result in enumerate(ranks_of(results, case)):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
        assert result["sessions"] == 1            # one model, one session, one optimizer
        assert result["misnamed"] == []           # each layer's states named after its own parameters
        if rank:
            continue          # full_state_dict gathers to rank 0
        for key, value in ref["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    if checkpointing != "reentrant":
        for blockwise, whole in zip(ranks_of(results, case), ranks_of(results, case + "_off")):
            _same(blockwise, whole)
            assert blockwise["frames"] == 3 and whole["frames"] == 1
            assert blockwise["stats"]["param_bytes"] == whole["stats"]["param_bytes"]


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_pieces_take_the_activations_the_pieces_before_hand_over(results, stage):
    """With ``param_dtype`` bfloat16 the activations between pieces are bfloat16 where Dynamo's
    example values say float32: each piece is compiled for what the pieces before it hand over
    (before, the first layer's backward failed on the dtype), and the run is bit for bit the one
    graph's on every rank, and one process in float32 to bfloat16's rounding."""
    ref = _llama_reference(None)
    for blockwise, whole in zip(ranks_of(results, f"llama_bf16_{stage}"), ranks_of(results, f"llama_bf16_{stage}_off")):
        assert blockwise["frames"] == 3 and whole["frames"] == 1
        _same(blockwise, whole)
        torch.testing.assert_close(torch.tensor(blockwise["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)


def test_bf16_with_hf_gradient_checkpointing_aligns_inside_the_checkpointed_bodies(results):
    """HF Llama, gradient checkpointing (non-reentrant) and ``param_dtype`` bfloat16 at stage 3:
    before, the checkpointed body's first ``linear`` met a float32 activation and a bfloat16
    weight and failed (align_compute_dtypes did not look inside the body). Now the same numbers
    as without checkpointing, compiled whole and as pieces, on every rank."""
    for ckpt, ckpt_off, plain in zip(ranks_of(results, "llama_bf16_ckpt"), ranks_of(results, "llama_bf16_ckpt_off"),
                                     ranks_of(results, "llama_bf16_3")):
        assert ckpt["frames"] == 3 and ckpt_off["frames"] == 1
        _same(ckpt, ckpt_off)
        assert ckpt["losses"] == plain["losses"]


@pytest.mark.parametrize("where", ["before", "between"])
def test_graph_breaks_before_and_inside_the_layer_loop(results, where):
    ref = _loop_reference(where)
    for rank, (blockwise, whole) in enumerate(zip(ranks_of(results, where), ranks_of(results, where + "_off"))):
        torch.testing.assert_close(torch.tensor(blockwise["losses"]), torch.tensor(ref["losses"]), rtol=1e-5,
                                   atol=1e-6)
        if rank == 0:
            for key, value in ref["state"].items():
                torch.testing.assert_close(blockwise["state"][key], value, rtol=1e-5, atol=1e-6)
        _same(blockwise, whole)
        n_params = sum(v.numel() for v in ref["state"].values())
        assert blockwise["param_bytes"] == whole["param_bytes"] <= (n_params * 4 // 2) * 1.01   # sharded over 2
        if where == "before":
            # the frame after the break holds the six blocks: block 0 (its input is the frame's,
            # which needs no gradient), one compile for blocks 1-5, and the head
            assert (whole["frames"], blockwise["frames"]) == (2, 4)
        else:
            # a break inside the loop: Dynamo compiles each block's forward as a frame of its own,
            # one compile that every block runs; nothing to cut
            assert blockwise["frames"] == whole["frames"]


class _NoGradFirstBlocks(torch.nn.Module):
    """Four blocks, the first two run under ``torch.no_grad()`` in the model's forward: a
    grad-mode region across block boundaries."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(zoo.MLPBlock() for _ in range(4))
        self.head = torch.nn.Linear(zoo.D, 3)

    def forward(self, x, y):
        with torch.no_grad():
            x = self.blocks[1](self.blocks[0](x))
        for block in self.blocks[2:]:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def test_a_no_grad_region_across_blocks_keeps_the_frame_one_graph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _NoGradFirstBlocks()
    ref = copy.deepcopy(model)
    started = time.monotonic_ns()
    compiled = torch.compile(model, backend="zero", options={"stage": 0, "inner_compiler": "eager",
                                                              "repeated_blocks": 2})
    x, y = zoo.batch(0)
    loss = compiled(x, y)
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    assert torch.equal(loss.detach(), ref_loss.detach())
    assert len([r for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]) == 1
    # the blocks under no_grad got no gradient, the others the eager one
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        assert (grads[name] is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)


def _hf_zoo():
    import transformers
    return {
        "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_layer=8, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)),
        "bert": (transformers.BertForMaskedLM, transformers.BertConfig(
            num_hidden_layers=8, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "t5": (transformers.T5ForConditionalGeneration, transformers.T5Config(
            num_layers=8, num_decoder_layers=8, d_model=32, d_ff=64, num_heads=4, d_kv=8, vocab_size=64,
            decoder_start_token_id=0, dropout_rate=0.0)),
    }


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_eight_layer_hf_models_compiled_whole_cut_by_default_and_exact(name):
    """Third-party models with 8 layers: the default ("auto") cuts them (T5: its first block,
    which holds the relative position bias, compiles apart from the seven like it), and training
    matches eager PyTorch."""
    cls, config = _hf_zoo()[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = cls(config)
    ref = copy.deepcopy(model)
    started = time.monotonic_ns()
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    # SGD: GPT-2's key bias has an exactly-zero gradient (softmax is shift-invariant), which
    # Adam would turn from rounding noise into whole updates (a fresh clone's run saw 1.05e-5)
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [(ids, ids) for ids in (torch.randint(1, 64, (2, 16), generator=g) for _ in range(2))]
    losses = train_on_rank_slices(_causal_lm_loss(compiled), opt, batches, 0, 1)
    ref_losses = train_on_rank_slices(_causal_lm_loss(ref), ref_opt, batches, 0, 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    state = zerocompile.full_state_dict(compiled)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    frames = [r["frame"] for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]
    blocks = [f for f in frames if f.endswith("[0]") or f.endswith("[1]")]
    assert blocks and len(frames) < 8, frames          # cut, and far fewer compiles than layers
