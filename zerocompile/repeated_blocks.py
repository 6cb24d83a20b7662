"""Deep models compile one block: a frame's identical repeated blocks (the layers of an
``nn.ModuleList``) are compiled once and the compiled block runs for every layer.

Dynamo traces a model compiled whole (``torch.compile(model, backend="zero")``,
``model.compile(...)``, HF's Trainer) into one graph holding every layer. Compiling that graph
as one frame costs AOTAutograd's trace and partition, the passes and the inner compiler's code
generation once per layer: at 80 layers, minutes. Here the frame's graph is cut where its
repeated blocks begin and end (the nodes' ``nn_module_stack``: children ``0..N-1`` of one
container, of one class); each piece becomes a frame of its own (``capture.compile_frame``), and
pieces with the same graph (same ops, the same shapes, dtypes, strides and kinds of inputs: the
layers) share one compiled frame, which takes each layer's parameters as its inputs, as a block
compiled with ``layer.compile()`` is reused by Dynamo for every layer. The pieces run in order,
joined by eager autograd, exactly as per-block compilation runs (FSDP2's and torchtitan's
regional compilation), with each layer's parameters gathered, freed and reduced by its piece.

``repeated_blocks`` (``CompilerOptions``) decides when: ``"auto"`` (frames with at least
``AUTO_MIN_BLOCKS`` identical blocks), an integer N (at least N), or ``"off"`` (one graph for
the frame: prefetch and the other passes then see across layers, at the cost of compiling
every layer).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from zerocompile import _torch_compat
from zerocompile.passes.align_compute_dtypes import _Aligner
from zerocompile.runtime.sharded_param import get_state

log = logging.getLogger("zerocompile")

AUTO_MIN_BLOCKS = 8
"""``repeated_blocks="auto"``: the fewest identical blocks that make a frame compile block by block."""

_INDEXED = re.compile(r"^(?P<container>.+?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")


def min_blocks(option) -> int | None:
    """The fewest repeated blocks that split a frame under the option's value (None: never)."""
    if option == "off":
        return None
    return AUTO_MIN_BLOCKS if option == "auto" else int(option)


def _stack_entries(node: torch.fx.Node) -> list:
    stack = node.meta.get("nn_module_stack") or {}
    return [(str(path), str(cls)) for path, cls in stack.values()]


def block_container(gm: torch.fx.GraphModule, minimum: int):
    """``(container, class)`` of the frame's outermost container with at least ``minimum``
    indexed children of one class that the graph's nodes run in, or None."""
    seen: dict = {}
    for node in gm.graph.nodes:
        for path, cls in _stack_entries(node):
            match = _INDEXED.match(path)
            if match:
                index = int(match.group("dot") or match.group("bracket"))
                seen.setdefault((match.group("container"), cls), set()).add(index)
    found = [(len(container), container, cls) for (container, cls), idx in seen.items() if len(idx) >= minimum]
    if not found:
        return None
    _, container, cls = min(found)
    return container, cls


def _block_of(node: torch.fx.Node, container: str, cls: str):
    for path, node_cls in _stack_entries(node):
        match = _INDEXED.match(path)
        if match and match.group("container") == container and node_cls == cls:
            return int(match.group("dot") or match.group("bracket"))
    return None


def _glue(node: torch.fx.Node, container: str) -> bool:
    """Whether ``node`` is code of the loop over the blocks itself (of the modules around the
    container, e.g. a ``getitem`` of a checkpointed layer's output), not of another module."""
    return all(container.startswith(path + ".") or container.startswith(path + "[")
               for path, _ in _stack_entries(node))


@dataclass(eq=False)
class Piece:
    """A run of consecutive nodes of the frame's graph: one block (``block`` its index) or the
    code between blocks (``block`` None)."""

    block: int | None
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    """Values it reads that are defined outside it (placeholders or earlier pieces' nodes), in
    order of first use."""
    outputs: list = field(default_factory=list)
    """Its nodes read by a later piece or by the frame's output."""


def pieces_of(gm: torch.fx.GraphModule, container: str, cls: str) -> list[Piece]:
    """The frame's graph cut into pieces in graph order. A ``get_attr`` (a checkpointed region's
    body) goes with its first user; a node of the loop's own code (``_glue``) that reads only
    the previous block's values (a ``getitem`` of its output) goes with that block, so every
    layer's piece is alike."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    owner: dict = {}
    for node in nodes:
        if node.op != "get_attr":
            owner[node] = _block_of(node, container, cls)
    for node in nodes:
        if node.op == "get_attr":
            first = next((u for u in node.users if u in owner), None)
            owner[node] = owner.get(first)
    pieces: list[Piece] = []
    where: dict = {}
    for node in nodes:
        block = owner[node]
        last = pieces[-1] if pieces else None
        if block is None and last is not None and last.block is not None and node.op != "get_attr" \
                and _glue(node, container):
            reads = node.all_input_nodes
            if reads and all(where.get(a) is last for a in reads):
                block = last.block           # glue that reads only the block just run
        if last is None or last.block != block:
            last = Piece(block)
            pieces.append(last)
        last.nodes.append(node)
        where[node] = last
    output = next(iter(gm.graph.find_nodes(op="output")))
    for piece in pieces:
        inside = set(piece.nodes)
        for node in piece.nodes:
            for arg in node.all_input_nodes:
                if arg not in inside and arg not in piece.inputs:
                    piece.inputs.append(arg)
    for node in nodes:
        readers = {where[u] for u in node.users if u in where and where[u] is not where[node]}
        if readers or output in node.users:
            where[node].outputs.append(node)
    return pieces


def piece_module(gm: torch.fx.GraphModule, piece: Piece) -> torch.fx.GraphModule:
    """The piece as a graph of its own: a placeholder per input (with the original's metadata:
    Dynamo's source of a parameter, the example value of an activation) and a tuple of its
    outputs."""
    graph = torch.fx.Graph()
    env: dict = {}
    for value in piece.inputs:
        placeholder = graph.placeholder(value.name)
        placeholder.meta.update(value.meta)
        if value.op != "placeholder":
            placeholder.meta.pop("grapharg", None)     # an activation: no source, kind "other" (never cast)
        env[value] = placeholder
    for node in piece.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in piece.outputs))
    sub = torch.fx.GraphModule(gm, graph)
    sub.meta.update(gm.meta)
    return sub


def _input_name(placeholder: torch.fx.Node) -> str:
    """A piece input's parameter name: from Dynamo's source, as ``capture`` names them."""
    source = _torch_compat.placeholder_source(placeholder)
    return (source is not None and _torch_compat.param_fqn(source)) or placeholder.name


def _example_of(value: torch.fx.Node, example_inputs: list, index: dict):
    if value.op == "placeholder":
        return example_inputs[index[value]]
    return value.meta["example_value"]


def _output_dtypes(sub: torch.fx.GraphModule, examples: list, param_dtype) -> list:
    """The dtype of each output of piece ``sub`` when it runs compiled on inputs like ``examples``
    (None for an output that is not a tensor): what the piece computes with its parameters in
    their compute dtype and the frame's floating-point inputs cast to ``param_dtype`` (the
    passes' casts), by running the piece's graph on fake tensors. Where nothing is cast, Dynamo's
    example values already say (no run)."""
    casts = []
    for placeholder, ex in zip(sub.graph.find_nodes(op="placeholder"), examples):
        dtype = None
        if isinstance(ex, torch.Tensor) and ex.is_floating_point():
            state = get_state(ex) if isinstance(ex, torch.nn.Parameter) else None
            if state is not None:
                dtype = state.compute_dtype
            elif param_dtype is not None and _torch_compat.input_kind(
                    _torch_compat.placeholder_source(placeholder), ex) == "input":
                dtype = param_dtype
        casts.append(dtype if dtype is not None and dtype != ex.dtype else None)
    values = [v.meta.get("example_value") for v in sub.graph.find_nodes(op="output")[0].args[0]]
    if all(c is None for c in casts):
        return [v.dtype if isinstance(v, torch.Tensor) else None for v in values]
    fake_mode = next((v.fake_mode for v in (*values, *examples) if isinstance(v, FakeTensor)), None)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(sub.graph, {}))     # a copy: its placeholders' example values change
    copy = torch.fx.GraphModule(sub, graph)
    with fake_mode:
        args = [torch.empty_strided(ex.shape, ex.stride(), dtype=cast or ex.dtype, device=ex.device)
                if isinstance(ex, torch.Tensor) else ex for ex, cast in zip(examples, casts)]
        for placeholder, arg in zip(copy.graph.find_nodes(op="placeholder"), args):
            placeholder.meta["example_value"] = arg
        # with align_compute_dtypes' casts at the matrix products, as the compiled piece has them
        outs = _Aligner(copy, param_dtype).run(*args) if param_dtype is not None else copy(*args)
    return [o.dtype if isinstance(o, torch.Tensor) else None for o in outs]


def _handed_over(example: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dynamo's example value ``example`` of an activation, in ``dtype`` (same fake mode, shape
    and strides, requires_grad)."""
    mode = example.fake_mode if isinstance(example, FakeTensor) else FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        out = torch.empty_strided(example.shape, example.stride(), dtype=dtype, device=example.device)
    return out.requires_grad_(example.requires_grad)


def structure_key(sub: torch.fx.GraphModule, examples: list) -> str:
    """Two pieces with the same key compute the same function of their inputs: the same ops with
    the same constants, inputs alike (shape, stride, dtype, device, requires_grad, parameter or
    not, and a parameter's shard settings), and checkpointed bodies alike."""

    index = {node: i for i, node in enumerate(sub.graph.nodes)}
    parts = []
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    for node, ex in zip(placeholders, examples):
        # the kind of input (a user's input is cast to param_dtype; an activation is not)
        parts.append(_torch_compat.input_kind(_torch_compat.placeholder_source(node), ex))
        if isinstance(ex, torch.Tensor):
            state = get_state(ex) if isinstance(ex, torch.nn.Parameter) else None
            settings = None if state is None else (state.stage, str(state.compute_dtype), state.keep_full,
                                                   state.group.name)
            parts.append(("in", tuple(ex.shape), tuple(ex.stride()), str(ex.dtype), str(ex.device),
                          ex.requires_grad, isinstance(ex, torch.nn.Parameter), settings))
        else:
            parts.append(("in", type(ex).__name__, str(ex)))
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            continue
        args = torch.fx.node.map_aggregate((node.args, node.kwargs), lambda v: _canonical(v, index))
        target = node.target
        if node.op == "get_attr":
            attr = getattr(sub, target)
            target = structure_key(attr, [n.meta.get("example_value") for n in attr.graph.find_nodes(
                op="placeholder")]) if isinstance(attr, torch.fx.GraphModule) else _canonical(attr, index)
        parts.append((node.op, repr(target), repr(args)))
    return repr(parts)


def _canonical(value, index: dict):
    """A node argument as the key compares it: a node by its position, a tensor by identity
    (its printed form elides values), anything else by its ``repr``."""
    if isinstance(value, torch.fx.Node):
        return f"%{index[value]}"
    if isinstance(value, torch.Tensor):
        return f"tensor@{id(value)}"
    return value


def _state_contained(pieces: list) -> bool:
    """Whether every grad-mode or autocast region of the graph (``torch.no_grad()``,
    ``torch.autocast`` inside the model) lies inside one piece: a cut between such a node and its
    restore would compile the pieces after it without the state. Each piece must hold an even
    number of grad-mode setters and as many autocast exits as enters."""
    for piece in pieces:
        targets = [n.target for n in piece.nodes if n.op == "call_function"]
        if targets.count(torch._C._set_grad_enabled) % 2 or \
                targets.count(torch.amp.autocast_mode._enter_autocast) != \
                targets.count(torch.amp.autocast_mode._exit_autocast):
            return False
    return True


class BlockwiseFrame:
    """The callable Dynamo runs for a frame compiled block by block: its pieces' compiled frames
    (``capture.FrameRunner``) in graph order, each layer's piece run by the compiled frame it
    shares with the layers like it."""

    def __init__(self, steps: list, outputs: list):
        self.steps = steps
        """``(runner, input slots, output slots, slots to free after it)`` in run order."""
        self.outputs = outputs
        """The frame's outputs: ``("slot", i)`` or ``("const", value)``."""

    def __call__(self, *args):
        slots: dict = dict(enumerate(args))
        for runner, ins, outs, free in self.steps:
            results = runner(*[slots[i] for i in ins])
            for slot, value in zip(outs, results):
                slots[slot] = value
            for slot in free:
                slots.pop(slot, None)
        return tuple(slots[v] if kind == "slot" else v for kind, v in self.outputs)


def compile_blockwise(gm: torch.fx.GraphModule, example_inputs: list, container: str, cls: str, compile_piece,
                      frame: str, param_dtype: torch.dtype | None = None):
    """Compile ``gm`` piece by piece (``compile_piece(sub, examples, name, session)`` -> a
    ``FrameRunner``; ``session``: the first piece's, so that all are one model's), one compile
    per distinct piece; returns the ``BlockwiseFrame``, or None where the frame cannot be cut
    (``_state_contained``). ``param_dtype``: the option's, which the frame's floating-point
    inputs are cast to (``cast_forward_inputs``).

    Each piece is compiled for the activations the pieces before it hand it when they run, not
    for Dynamo's example values: Dynamo traced the model in its own dtypes, but a piece computes
    in its parameters' compute dtype (``param_dtype``), so the residual stream a bfloat16 piece
    hands over is bfloat16 where Dynamo's example says float32 (``_handed_over``)."""
    pieces = pieces_of(gm, container, cls)
    if not _state_contained(pieces):
        log.info("[%s] not compiled block by block: a torch.no_grad() or torch.autocast region of the "
                 "frame spans its blocks' boundaries; compiling it as one graph", frame)
        return None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    index = {node: i for i, node in enumerate(placeholders)}
    slot = dict(index)
    for piece in pieces:
        for node in piece.outputs:
            slot.setdefault(node, len(slot))
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = output.args[0]
    flat = values if isinstance(values, (tuple, list)) else (values,)
    returned = {v for v in flat if isinstance(v, torch.fx.Node)}
    compiled: dict = {}
    steps = []
    last_read: dict = {}
    for position, piece in enumerate(pieces):
        for value in piece.inputs:
            last_read[value] = position
    blocks = sorted({p.block for p in pieces if p.block is not None})
    handed: dict = {}           # activation node -> its example as the piece that makes it hands it over
    out_dtypes: dict = {}       # structure key -> the dtypes of its outputs
    for position, piece in enumerate(pieces):
        examples = [handed[v] if v in handed else _example_of(v, example_inputs, index) for v in piece.inputs]
        sub = piece_module(gm, piece)
        for placeholder, ex in zip(sub.graph.find_nodes(op="placeholder"), examples):
            if placeholder.meta.get("example_value") is not None and isinstance(ex, torch.Tensor):
                placeholder.meta["example_value"] = ex
        key = structure_key(sub, examples)
        runner = compiled.get(key)
        if runner is None:
            if piece.block is not None:
                name = f"{frame} {container.rsplit('.', 1)[-1]}[{piece.block}]"
            else:
                name = f"{frame} part {position}"
            session = next(iter(compiled.values())).session if compiled else None
            runner = compile_piece(sub, examples, name, session)
            compiled[key] = runner
        else:
            # its parameters get their states (under their own names) and become ZeroParameters
            # now, as a compiled piece's do, before Dynamo builds the frame's guards
            runner.take_parameters(examples, [_input_name(node) for node in sub.graph.find_nodes(op="placeholder")])
        if key not in out_dtypes:
            out_dtypes[key] = _output_dtypes(sub, examples, param_dtype)
        for node, dtype in zip(piece.outputs, out_dtypes[key]):
            ex = node.meta.get("example_value")
            if dtype is not None and isinstance(ex, torch.Tensor) and ex.dtype != dtype:
                handed[node] = _handed_over(ex, dtype)
        # an activation goes once its last reader has run (the caller's inputs are the caller's)
        free = [slot[v] for v in piece.inputs
                if last_read[v] == position and v.op != "placeholder" and v not in returned]
        steps.append((runner, [slot[v] for v in piece.inputs], [slot[n] for n in piece.outputs], free))
    outputs = [("slot", slot[v]) if isinstance(v, torch.fx.Node) else ("const", v) for v in flat]
    log.info("[%s] compiled block by block: %d pieces (%d blocks of %s in '%s'), %d distinct compiled",
             frame, len(pieces), len(blocks), cls.rsplit(".", 1)[-1].strip("'>"), container, len(compiled))
    return BlockwiseFrame(steps, outputs)
