"""Modules a process imports lazily on its first ``backend="zero"`` compile (inductor's
code generators that AOTAutograd's partitioner reaches, torch.export, the passes) and the
transformers model files the tests build: imported once by the fork server of
``dist_utils`` so that each forked rank starts with them, instead of paying about 0.8 s of
CPU for them in every rank of every multi-rank test. Imports only: nothing runs, no thread
pool starts, so forking after them is safe.

Two more things each rank would otherwise redo, both pure Python state: Dynamo's table of
function names by source line (``torch._dynamo.funcname_cache``, private: it tokenizes each
source file a trace reads, ~0.6 s for an HF Llama's files), filled here for the files the tests
trace; and ``gc.freeze()`` at the end, so that the collections in each rank (Dynamo's after a
compile, ZeroOptimizer's after a step that compiled) do not walk the millions of objects of
these modules (~0.14 s each). tests/test_dist_utils.py fails if a rank starts without all this
(the fork server skips a preload module that raises ImportError without a word, as it would if
torch moved the private module)."""

from __future__ import annotations

import gc
import importlib
import pkgutil

import torch._dynamo.backends
import torch._dynamo.funcname_cache

import zerocompile
import zerocompile.cli
import zerocompile.passes
import zerocompile.passes.analyses
import zerocompile.passes.lowerings
import zerocompile.runtime

TORCH = ["torch._inductor.compile_fx", "torch._dynamo.backends.inductor", "torch.utils.cpp_extension",
         "torch.export._trace", "torch.distributed.tensor.experimental", "torch.fx.experimental.validator",
         "torch._higher_order_ops.passes.inline_invoke_subgraph", "torch.utils.checkpoint",
         "torch._dynamo.repro.after_dynamo", "torch._dynamo.dce_extra_outputs",
         "torch._functorch._aot_autograd.subclass_codegen", "torch._inductor.compiler_bisector",
         "torch._subclasses.schema_check_mode", "sympy.combinatorics", "sympy.tensor.tensor"]
TRANSFORMERS = ["llama", "gpt2", "bert", "t5", "mistral", "qwen2"]
TRACED = ["torch.nn.functional", "torch.nn.modules.module", "torch.nn.modules.linear", "torch.nn.modules.sparse",
          "torch.nn.modules.activation", "torch.nn.modules.normalization", "torch.nn.modules.container",
          "torch.nn.modules.dropout", "torch.utils.checkpoint", "transformers.modeling_utils",
          "transformers.activations", "transformers.cache_utils", "transformers.integrations.sdpa_attention",
          "transformers.loss.loss_utils", "transformers.pytorch_utils", "zerocompile.runtime.zero_parameter"]


def _import_all() -> None:
    for name in TORCH:
        importlib.import_module(name)
    for info in pkgutil.iter_modules(torch._dynamo.backends.__path__, "torch._dynamo.backends."):
        try:
            importlib.import_module(info.name)      # what torch's backend registry loads on first use
        except ImportError:
            pass
    for package in (zerocompile, zerocompile.cli, zerocompile.passes, zerocompile.passes.analyses,
                    zerocompile.passes.lowerings, zerocompile.runtime):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    try:
        for name in TRANSFORMERS:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:         # transformers is a test extra; the tests that need it skip without it
        pass
    traced = TRACED + [f"transformers.models.{name}.modeling_{name}" for name in TRANSFORMERS]
    for name in traced:
        try:
            path = importlib.import_module(name).__file__
        except ImportError:
            continue
        torch._dynamo.funcname_cache.get_funcname(path, 1)


_import_all()
gc.freeze()
