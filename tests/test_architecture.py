"""The layering of docs/architecture.md, checked on the source: no import cycle and no import
upward, counting imports inside functions (a function-local import is still a dependency) and
leaving out imports under ``if TYPE_CHECKING:`` (they never run).

Layers, top to bottom; a module imports its own layer and the layers below it only:

    tools      the CLI, plan, tune, measure, script runner, integrations, DeepSpeed training, the package root
    front      compile (backend, capture, config), optim (the optimizer and its collaborators), io
    passes     zerocompile.passes
    runtime    zerocompile.runtime
    leaves     zerocompile.errors, zerocompile.env, zerocompile._torch_compat
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"zerocompile": ROOT / "zerocompile", "zerocompile.passes": ROOT / "passes",
            "zerocompile.runtime": ROOT / "runtime"}
LAYERS = ("leaves", "runtime", "passes", "front", "tools")
LEAVES = {"zerocompile.errors", "zerocompile.env", "zerocompile._torch_compat"}
TOOLS = {"zerocompile", "zerocompile.__main__", "zerocompile.cli", "zerocompile.plan", "zerocompile.tune",
         "zerocompile.measure", "zerocompile.plan_worker", "zerocompile.script_runner", "zerocompile.integrations", "zerocompile.deepspeed_training"}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def layer_of(name: str) -> str:
    if name in LEAVES or any(name.startswith(leaf + ".") for leaf in LEAVES):
        return "leaves"
    if any(name == t or name.startswith(t + ".") for t in TOOLS if t != "zerocompile") or name == "zerocompile":
        return "tools"
    for package in ("zerocompile.runtime", "zerocompile.passes"):
        if name == package or name.startswith(package + "."):
            return package.rpartition(".")[2]
    return "front"


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _targets(name: str, path: Path, node: ast.AST, known: dict) -> list[str]:
    """The package's modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".")
            if path.name != "__init__.py":
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        wanted = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
    out = []
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    for name, path in known.items():
        graph.add_node(name)
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not _type_checking_only(node, parents):
                for target in _targets(name, path, node, known):
                    # a package's own __init__ is loaded by importing any of its modules: not an edge
                    if not name.startswith(target + "."):
                        graph.add_edge(name, target, line=node.lineno)
    return graph


def test_the_graph_sees_every_package_and_function_local_imports():
    graph = import_graph()
    assert {"zerocompile.optimizer", "zerocompile.passes.manager", "zerocompile.runtime.comm",
            "zerocompile.errors"} <= set(graph)
    # capture imports the pass manager at module level; the check must also see imports inside functions
    assert graph.has_edge("zerocompile.capture", "zerocompile.passes.manager")
    local = [(a, b) for a, b, d in graph.edges(data=True)
             if any(isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == d["line"]
                    for f in [ast.parse(modules()[a].read_text())]
                    for fn in ast.walk(f) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(fn))]
    assert local, "no function-local import found: the scanner misses them"


def test_no_import_cycles():
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1)
    assert not cycles, "import cycles (break them by moving the shared piece down a layer):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_upward_imports():
    graph = import_graph()
    upward = [f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)}) at line {d['line']}"
              for a, b, d in graph.edges(data=True) if LAYERS.index(layer_of(b)) > LAYERS.index(layer_of(a))]
    assert not upward, "imports against the layering of docs/architecture.md:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaves_import_nothing_of_the_package(leaf):
    # a leaf package (``_torch_compat``) imports its own modules only
    graph = import_graph()
    inside = [m for m in graph if m == leaf or m.startswith(leaf + ".")]
    assert not [t for m in inside for t in graph.successors(m) if not (t == leaf or t.startswith(leaf + "."))]


def test_no_module_near_a_thousand_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 700}
    assert not long, f"modules over 700 lines (split them by job): {long}"


def test_passes_take_their_options_as_arguments():
    """Only the pass manager reads the config (it binds each pass's options); a pass reading
    ``ctx.config`` would hide what it depends on."""
    readers = []
    for name, path in modules().items():
        if not name.startswith("zerocompile.passes.") or name in ("zerocompile.passes.manager",
                                                                  "zerocompile.passes.context"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name) \
                    and node.value.id == "ctx":
                readers.append(f"{name}:{node.lineno}")
    assert not readers, f"passes reading ctx.config (bind the option in passes/manager.py instead): {readers}"


def test_no_warnings_filter_is_installed_at_import():
    installed = []
    for name, path in modules().items():
        for node in ast.parse(path.read_text()).body:      # module level only
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                    and "filterwarnings" in ast.unparse(node.value.func):
                installed.append(name)
    assert not installed, f"modules that change the warnings filters when imported: {installed}"


SESSION_MODULE = "zerocompile.runtime.session"
_CONTAINERS = {"dict", "list", "set", "defaultdict", "collections.defaultdict", "OrderedDict",
               "collections.OrderedDict", "deque", "collections.deque", "weakref.WeakSet",
               "weakref.WeakKeyDictionary", "weakref.WeakValueDictionary"}
_MUTATORS = {"add", "append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "discard",
             "remove", "appendleft"}
STATELESS = {"zerocompile.runtime.stages._STAGE3_OFFLOAD": "a stage's rules: methods only, no attributes",
             "zerocompile.runtime.timer_ops._LIBRARY": "torch.library's registration handle of the timer ops",
             "zerocompile.backend._OVERRIDE": "a ContextVar: options overridden in one context, not process-wide",
             "zerocompile.collection_pause._PAUSED": "a ContextVar: whether this context's compile paused the "
                                                     "garbage collector, not process-wide",
             "zerocompile.plan.HARDWARE": "a read-only mapping (MappingProxyType) of hardware presets"}
"""Module-level instances that hold no state of the process's training, with why."""


def _module_level_objects(tree: ast.Module) -> dict:
    """``{name: (line, what)}`` of the module-level names bound to a container or to an instance
    (a call of a capitalised name: ``Process()``, ``OpenChannels()``)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        else:
            continue
        if target == "__all__":
            continue
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            out[target] = (node.lineno, "container")
        elif isinstance(value, ast.Call):
            func = ast.unparse(value.func)
            if func in _CONTAINERS:
                out[target] = (node.lineno, "container")
            elif func.rpartition(".")[2].lstrip("_")[:1].isupper():
                out[target] = (node.lineno, "instance")
    return out


def _mutated_names(trees: dict) -> set:
    """Names the package mutates anywhere: ``NAME.add(...)`` (and the other mutating methods),
    ``NAME[...] = ...``, ``del NAME[...]``, ``NAME.attr = ...``."""
    out = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                    and isinstance(node.func.value, ast.Name):
                out.add(node.func.value.id)
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                    out.add(t.value.id)
    return out


def test_the_only_module_level_registry_is_the_session_modules():
    """Process-wide state lives in ``runtime/session.py`` (``PROCESS``: the sessions, the watchdog,
    the registries custom ops reach); elsewhere a module-level container the package mutates, or a
    module-level instance of a class, is a registry that couples models to each other."""
    trees = {name: ast.parse(path.read_text()) for name, path in modules().items()}
    mutated = _mutated_names(trees)
    found = []
    for name, tree in trees.items():
        for target, (line, what) in _module_level_objects(tree).items():
            key = f"{name}.{target}"
            if name == SESSION_MODULE or key in STATELESS:
                continue
            if what == "instance" or target in mutated:
                found.append(f"{key} (line {line}, {what})")
    assert not found, "module-level mutable state outside runtime/session.py (make it a session's, or " \
        "PROCESS.service(...) for what custom ops reach):\n" + "\n".join(found)


def test_the_registry_check_catches_one():
    """The check above on a made-up module: a registry it must report, and constants it must not."""
    tree = ast.parse("REG = {}\nTABLE = {'a': 1}\nHOLDER = _Holder()\ndef f(x):\n    REG[x] = 1\n")
    objects = _module_level_objects(tree)
    assert set(objects) == {"REG", "TABLE", "HOLDER"} and objects["HOLDER"][1] == "instance"
    assert _mutated_names({"m": tree}) == {"REG"}



_PARAM_NAMES = {"param", "p", "arg", "ex", "parameter", "weight"}
ATTACHES = {("zerocompile.runtime.sharded_param", "setattr(param, _ATTR, state)"):
            "attach_state: the shard state, the one attribute zerocompile hangs off a parameter (its options are "
            "the session's)",
            ("zerocompile.runtime.zero_parameter", "param.__class__"):
            "adopt: a sharded parameter becomes a ZeroParameter (p.grad, eager ops, state_dict on shards)"}
"""What the package may set on a parameter, ``(module, what)``, with why."""


def _attributes_set_on_parameters(tree: ast.Module) -> list:
    """``(line, what)`` of each attribute the code sets on a parameter: ``setattr(param, ...)``,
    ``param.attr = ...`` or ``object.__setattr__(param, ...)``, ``param`` any of the names the
    package gives parameters (``_PARAM_NAMES``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__") \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in _PARAM_NAMES:
            out.append((node.lineno, ast.unparse(node)))
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in _PARAM_NAMES \
                        and t.attr not in ("data", "grad", "requires_grad"):
                    out.append((node.lineno, ast.unparse(t)))
    return out


def test_no_option_or_state_is_set_on_the_users_parameters():
    """Options reach the runtime through the model's session, and the optimizer that steps a
    parameter is found through the process's optimizers (``PROCESS.optimizer_of``): nothing but
    the shard state is set on the user's ``nn.Parameter`` (``ATTACHES``)."""
    found = []
    for name, path in modules().items():
        found += [f"{name}:{line} {what}" for line, what in _attributes_set_on_parameters(ast.parse(path.read_text()))
                  if (name, what) not in ATTACHES]
    assert not found, "attributes set on the user's parameters (keep them in the session or the shard state):\n" + \
        "\n".join(found)


def test_the_parameter_attribute_check_catches_one():
    tree = ast.parse("def f(param, p):\n    setattr(param, '_x', 1)\n    p._scale = 2\n    p.grad = None\n")
    assert sorted(line for line, _ in _attributes_set_on_parameters(tree)) == [2, 3]
