"""Pass (Dynamo graphs, ``param_dtype`` set): cast the float32 operands of matrix products to
the compute dtype where the parameters' cast left the product with mixed dtypes.

Dynamo traces a frame with the parameters as they are (float32); zerocompile casts them to
``param_dtype`` afterwards, in the graph. Model code that reads a dtype while it runs was
traced with float32 in it: Hugging Face's RMSNorm computes in float32 and casts back with
``hidden.to(input_dtype)``, where ``input_dtype`` was float32 when traced, so the cast is not
in the graph; its output, a bfloat16 weight times a float32 activation, is then float32, and
the next ``linear`` meets a bfloat16 weight with a float32 input: torch refuses a matrix
product of mixed dtypes. Had the model run with bfloat16 parameters, ``input_dtype`` would
have been bfloat16 and the cast there.

This pass propagates fake tensors through the graph with the parameters in the compute dtype
and, at each matrix product (``linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm``,
``baddbmm``, ``scaled_dot_product_attention``, ``einsum``) whose floating-point operands mix
the compute dtype with another, casts the other operands to the compute dtype: what the
model's own cast would have done, one op later (an elementwise op of mixed dtypes computes in
float32, more precisely, before the cast). Products whose operands agree are left alone
(``a.float() @ b.float()`` stays float32). If propagation fails on an op it does not know, the
pass leaves the graph as it is (the product, if any, then fails as before) and logs why.
A checkpointed region (``torch.utils.checkpoint``, Hugging Face's gradient checkpointing, traced
by Dynamo as ``tag_activation_checkpoint`` of a body graph) is aligned inside its body, on the
values it is called with: HF Llama with gradient checkpointing and a bfloat16 ``param_dtype``
failed in the body's first ``linear`` before.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from zerocompile.passes.context import PassContext

MATMUL_FUNCTIONS = {
    torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm,
    torch.addmm, torch.baddbmm, torch.nn.functional.scaled_dot_product_attention, torch.einsum,
    torch._C._nn.scaled_dot_product_attention,
}
MATMUL_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__", "__rmatmul__"}


def _is_matmul(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in MATMUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in MATMUL_METHODS)


def _float_inputs(node: torch.fx.Node, env: dict) -> list:
    return [n for n in node.all_input_nodes
            if isinstance(env.get(n), torch.Tensor) and env[n].is_floating_point()]


class _Aligner(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, dtype: torch.dtype):
        super().__init__(gm)
        self.dtype = dtype
        self.casts = 0

    def run_node(self, node: torch.fx.Node):
        if node.op == "placeholder":
            return node.meta["example_value"]
        if node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint:
            self._align_body(node)
        if _is_matmul(node):
            inputs = _float_inputs(node, self.env)
            dtypes = {self.env[n].dtype for n in inputs}
            if len(dtypes) > 1 and self.dtype in dtypes:
                for arg in inputs:
                    if self.env[arg].dtype == self.dtype:
                        continue
                    with self.graph.inserting_before(node):
                        cast = self.graph.call_method("to", (arg, self.dtype))
                    cast.meta["zerocompile"] = {"role": "compute_dtype_cast"}
                    self.env[cast] = self.env[arg].to(self.dtype)
                    cast.meta["example_value"] = self.env[cast]
                    node.replace_input_with(arg, cast)
                    self.casts += 1
        value = super().run_node(node)
        if node.op != "output" and isinstance(value, torch.Tensor):
            node.meta["example_value"] = value
        return value

    def _align_body(self, node: torch.fx.Node) -> None:
        """A checkpointed region (``torch.utils.checkpoint``, HF's gradient checkpointing): its
        body is a graph of its own (``get_attr``), aligned the same way on the values it is
        called with, in place (the recompute in backward runs the same body)."""
        body = self.fetch_attr(node.args[0].target)
        args = [self.env[a] if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
        for placeholder, value in zip(body.graph.find_nodes(op="placeholder"), args):
            placeholder.meta["example_value"] = value
        inner = _Aligner(body, self.dtype)
        inner.run(*args)
        if inner.casts:
            body.recompile()
            self.casts += inner.casts


def align_compute_dtypes(gm: torch.fx.GraphModule, ctx: PassContext, *, param_dtype, **_) -> torch.fx.GraphModule:
    dtype = param_dtype
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    fakes = [n.meta.get("example_value") for n in placeholders]
    mode = next((v.fake_mode for v in fakes if isinstance(v, FakeTensor)), None)
    if dtype is None or mode is None or any(v is None for v in fakes):
        ctx.results["align_compute_dtypes"] = {"casts": 0, "skipped": "no fake inputs"}
        return gm
    aligner = _Aligner(gm, dtype)
    try:
        with mode:
            aligner.run(*fakes)
    except Exception as err:  # noqa: BLE001 - an op fake propagation does not know: leave the graph
        ctx.logger.info("[%s] align_compute_dtypes: fake propagation stopped (%s: %s); graph left as traced",
                        ctx.frame, type(err).__name__, str(err).splitlines()[0][:200])
        ctx.results["align_compute_dtypes"] = {"casts": aligner.casts, "skipped": type(err).__name__}
        gm.recompile()
        return gm
    ctx.results["align_compute_dtypes"] = {"casts": aligner.casts}
    if aligner.casts:
        ctx.logger.debug("[%s] align_compute_dtypes: %d operands cast to %s", ctx.frame, aligner.casts, dtype)
    gm.recompile()
    return gm
