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


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def test_the_collector_is_paused_while_the_backend_compiles_and_runs_again_after(monkeypatch):
    """No automatic collection runs while ``backend="zero"`` compiles a frame (its full walks
    of every object were a fifth of a small model's compile); it runs again after, and the
    step's own collection frees what the compile left."""
    from zerocompile import backend

    seen = []
    collections = []

    def on_collection(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        started = len(collections)
        gc.callbacks.append(on_collection)
        try:
            # allocations that start several collections while the collector runs
            junk = [[object()] for _ in range(50_000)]
            del junk
            return compile_frame(*args, **kwargs)
        finally:
            gc.callbacks.remove(on_collection)
            seen.append(len(collections) - started)

    compile_frame = backend.compile_frame
    monkeypatch.setattr(backend, "compile_frame", watched)
    torch.compiler.reset()
    assert gc.isenabled()
    model = _mlp()
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.SGD, lr=0.1)
    compiled(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert seen == [False, 0], seen        # compiled with the collector off, and none ran
    assert gc.isenabled()
    torch.compiler.reset()


def test_a_collector_the_user_turned_off_stays_off_and_a_failed_compile_turns_it_back_on():
    torch.compiler.reset()
    gc.disable()
    try:
        compiled = torch.compile(_mlp(), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
        compiled(torch.randn(4, 8)).sum().backward()
        assert not gc.isenabled()
    finally:
        gc.enable()
    torch.compiler.reset()
    compiled = torch.compile(_mlp(), backend="zero", options={"stage": 3, "no_such_option": 1})
    try:
        compiled(torch.randn(4, 8))
    except Exception as err:     # Dynamo wraps the backend's ZeroConfigError
        assert "no_such_option" in str(err)
    else:
        raise AssertionError("an unknown option compiled")
    assert gc.isenabled()
    torch.compiler.reset()


def test_inductors_code_generation_runs_with_the_collector_and_the_pause_comes_back_after():
    """``collection_resumed`` (around inductor's code generation) turns the collector on only
    inside zerocompile's own pause, and pauses it again after; a collector the user turned off
    stays off inside both."""
    from zerocompile.collection_pause import collection_paused, collection_resumed

    assert gc.isenabled()
    with collection_resumed():
        assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
        with collection_resumed():
            assert gc.isenabled()
        assert not gc.isenabled()
        try:
            with collection_resumed():
                raise KeyError("inside")
        except KeyError:
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            with collection_resumed():
                assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
