"""Dynamo's tracing garbage: reference cycles that hold the example inputs of the frames it
compiled (activations of the step that compiled them; on an HF Llama whose decoder layers are
compiled one by one, the position ids). ``ZeroOptimizer.step()`` collects them once after a
step that compiled frames, so that the memory of later steps is the program's own, in a real
run as in ``zerocompile plan`` (which measures the second step: with transformers 5.25 a real
run's peak counted the first step's position ids, 256 bytes, and plan's did not)."""

from __future__ import annotations

import gc
import weakref

import torch
import transformers

import zerocompile

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, use_cache=False, attn_implementation="sdpa")


def _positions_alive_after_first_step(collect: bool) -> bool:
    """One step of a tiny Llama whose layers are compiled one by one (as FSDP2 users and
    benchmarks/train_llama.py do); whether the step's position ids are still alive after
    ``opt.step()``. ``collect=False``: the step behaves as if it had collected already."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    for layer in model.model.layers:
        layer.compile(backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    if not collect:
        opt._collected_through = float("inf")
    ids = torch.randint(0, 64, (1, 16))
    x = model.model.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])[None]
    rotary = model.model.rotary_emb(x, position_ids=positions)
    alive = weakref.ref(positions.untyped_storage())
    for layer in model.model.layers:
        x = layer(x, position_ids=positions, position_embeddings=rotary)
    x.square().mean().backward()
    del x, positions, rotary
    opt.step()
    return alive() is not None


def test_the_first_step_frees_what_compiling_its_frames_held():
    """With the automatic collector off (it runs at points nobody controls), the position ids
    the layer frames were compiled on are held by Dynamo's garbage after a step that does not
    collect, and freed by one that does."""
    gc.collect()
    gc.disable()
    try:
        torch.compiler.reset()
        assert _positions_alive_after_first_step(collect=False), (
            "Dynamo's tracing no longer leaves cycles holding example inputs: this test no longer tests anything")
        torch.compiler.reset()
        gc.collect()
        assert not _positions_alive_after_first_step(collect=True)
    finally:
        gc.enable()
        torch.compiler.reset()
