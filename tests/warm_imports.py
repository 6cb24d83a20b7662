"""Modules a process imports lazily on its first ``backend="zero"`` compile (inductor's
code generators that AOTAutograd's partitioner reaches, torch.export, the passes) and the
transformers model files the tests build: imported once by the fork server of
``dist_utils`` so that each forked rank starts with them, instead of paying about 0.8 s of
CPU for them in every rank of every multi-rank test. Imports only: nothing runs, no thread
pool starts, so forking after them is safe."""

from __future__ import annotations

import importlib
import pkgutil

import torch._dynamo.backends

import zerocompile
import zerocompile.passes
import zerocompile.runtime

TORCH = ["torch._inductor.compile_fx", "torch._dynamo.backends.inductor", "torch.utils.cpp_extension",
         "torch.export._trace", "torch.distributed.tensor.experimental", "torch.fx.experimental.validator",
         "torch._higher_order_ops.passes.inline_invoke_subgraph", "torch.utils.checkpoint",
         "torch._dynamo.repro.after_dynamo", "torch._dynamo.dce_extra_outputs",
         "torch._functorch._aot_autograd.subclass_codegen", "torch._inductor.compiler_bisector",
         "torch._subclasses.schema_check_mode", "sympy.combinatorics", "sympy.tensor.tensor"]
TRANSFORMERS = ["llama", "gpt2", "bert", "t5", "mistral", "qwen2"]


def _import_all() -> None:
    for name in TORCH:
        importlib.import_module(name)
    for info in pkgutil.iter_modules(torch._dynamo.backends.__path__, "torch._dynamo.backends."):
        try:
            importlib.import_module(info.name)      # what torch's backend registry loads on first use
        except ImportError:
            pass
    for package in (zerocompile, zerocompile.passes, zerocompile.runtime):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    try:
        for name in TRANSFORMERS:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:         # transformers is a test extra; the tests that need it skip without it
        pass


_import_all()
