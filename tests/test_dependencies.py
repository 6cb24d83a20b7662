"""pyproject.toml declares exactly what the code imports: the base dependencies are the
third-party distributions the installed code (zerocompile/, passes/, runtime/) imports, the
feature extras (``plot``) what it imports lazily for an optional feature, the ``test`` extra what
tests/ imports beyond the base. And a plain install (no extras) runs ``zerocompile --help``: checked
in a subprocess whose imports are limited to the standard library and the base dependencies
with their own requirements."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = [ROOT / "zerocompile", ROOT / "passes", ROOT / "runtime"]
TESTS = ROOT / "tests"
NOT_FEATURE_EXTRAS = ("test", "bench")
INTEGRATIONS = ROOT / "zerocompile" / "integrations"
INTEGRATION_EXTRAS = ("hf", "trl")
"""``zerocompile.integrations`` modules exist to use their libraries (``ZeroTrainer`` subclasses
``transformers.Trainer``, ``ZeroDPOTrainer`` TRL's ``DPOTrainer``): they import the ``hf`` and
``trl`` extras at module level, and nothing imports them but the user (``import zerocompile`` does
not; the plain-install check below skips them)."""
LAZY_ONLY = {"runtime/triton_common.py"}
"""Installed modules that import an optional package at module level because that package
needs it (Triton's interpreter looks for ``triton.language`` among a kernel module's globals),
and that no installed module imports at module level (checked below): they load only when a
feature that has the package runs, so their imports count as inside a function."""
TEST_PLUGINS = {"pytest-xdist"}
"""Pytest plugins the test command loads (``make test`` runs ``pytest -n``), which no test imports."""
"""Every other extra serves an optional feature of the installed code (``plot``): its packages are
imported inside functions only, and a missing one is a one-line error that names the extra."""


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _declared() -> tuple[set, dict]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs}

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module name, imported at module level?) for every absolute import in ``path``,
    including ``pytest.importorskip("name")`` calls. Code in a function body is not module level;
    class bodies and module-level ``if``/``try`` blocks are."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node, module_level):
        if isinstance(node, ast.Import):
            found.extend((a.name.partition(".")[0], module_level) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module.partition(".")[0], module_level))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)):
            found.append((node.args[0].value.partition(".")[0], module_level))
        inner = module_level and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return found


def _third_party(folders: list, local: set) -> dict:
    """distribution -> {"module_level": bool, "where": [files]} for the third-party imports of
    every .py file under ``folders``; stdlib, zerocompile and the ``local`` module names are skipped.
    An import name no installed distribution provides counts as a distribution of that name."""
    providers = importlib.metadata.packages_distributions()
    out = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            lazy = str(path.relative_to(ROOT)) in LAZY_ONLY
            for name, module_level in _imports(path):
                module_level = module_level and not lazy
                if name in sys.stdlib_module_names or name == "zerocompile" or name in local:
                    continue
                for dist in providers.get(name, [name]):
                    entry = out.setdefault(_norm(dist), {"module_level": False, "where": []})
                    entry["module_level"] |= module_level
                    entry["where"].append(str(path.relative_to(ROOT)))
    return out


def _report(imported: dict, dists: set) -> str:
    return "; ".join(f"{d} (in {', '.join(sorted(set(imported[d]['where'])))})" for d in sorted(dists))


def test_base_dependencies_are_what_the_installed_code_imports():
    base, extras = _declared()
    imported = _third_party(INSTALLED, local=set())
    feature_extras = [e for e in extras if e not in NOT_FEATURE_EXTRAS]
    optional = set().union(*(extras[e] for e in feature_extras))
    needed = set(imported) - optional
    assert not needed - base, (
        f"imported but not in [project] dependencies: {_report(imported, needed - base)}. Declare it there, "
        "or, for an optional feature, import it inside the function that needs it and add an extra for it")
    assert not base - needed, f"declared in [project] dependencies but never imported: {sorted(base - needed)}"
    for extra in feature_extras:
        assert extras[extra] <= set(imported), f"extra {extra!r} declares unused {sorted(extras[extra] - set(imported))}"
    integration = set().union(*(extras[e] for e in INTEGRATION_EXTRAS))
    integration_only = {d for d in integration & set(imported)
                        if all(w.startswith(str(INTEGRATIONS.relative_to(ROOT))) for w in imported[d]["where"])}
    eager = {d for d in optional & set(imported) if imported[d]["module_level"]} - integration_only
    assert not eager, f"optional-feature packages imported at module level: {_report(imported, eager)}"


def test_lazy_only_modules_are_imported_inside_functions_only():
    stems = {Path(m).stem for m in LAZY_ONLY}
    eager = []
    for folder in INSTALLED:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and any(s in ast.unparse(node) for s in stems):
                    up = node
                    while up in parents and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        up = parents[up]
                    if not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        eager.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert stems and not eager, f"modules of LAZY_ONLY imported at module level: {eager}"


def test_test_extra_is_what_the_tests_import():
    base, extras = _declared()
    # the tests' own helpers, and the benchmark scripts the benchmark tests import by path
    local = {p.stem for p in TESTS.glob("*.py")} | {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    imported = _third_party([TESTS], local=local)
    needed = set(imported) - base
    test = extras["test"]
    assert not needed - test, f"imported by tests but not in the test extra: {_report(imported, needed - test)}"
    assert not test - needed - TEST_PLUGINS, (
        f"declared in the test extra but never imported by tests: {sorted(test - needed - TEST_PLUGINS)}")
    makefile = (ROOT / "Makefile").read_text()
    assert "-n $(TEST_WORKERS)" in makefile, "pytest-xdist is in the test extra for make test's -n"


def _make_bytecode_env(environ: dict) -> str:
    """What a ``make`` recipe of this repository sees of Python's bytecode settings, given the
    caller's environment: ``"<PYTHONPYCACHEPREFIX>|<PYTHONDONTWRITEBYTECODE or 'unset'>"``."""
    rule = 'print-bytecode-env: ; @echo "$$PYTHONPYCACHEPREFIX|$${PYTHONDONTWRITEBYTECODE-unset}"'
    done = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "--eval", rule, "print-bytecode-env"],
                          env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_make_recipes_keep_pythons_bytecode_cache_in_the_venv():
    """With ``PYTHONDONTWRITEBYTECODE`` set (as this project's CI machine sets it) every new
    interpreter compiled every module it imported from source, about 6 s a process: the
    Makefile's recipes run without it and write the cache under ``.venv/pycache``, and keep a
    prefix the caller chose."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "VENV")}
    environ["PYTHONDONTWRITEBYTECODE"] = "1"
    assert _make_bytecode_env(environ) == f"{ROOT / '.venv' / 'pycache'}|unset"
    assert _make_bytecode_env({**environ, "PYTHONPYCACHEPREFIX": "/tmp/my-pycache"}) == "/tmp/my-pycache|unset"


def _closure(dists: set) -> set:
    """``dists`` and, recursively, what they require (requirements of extras left out)."""
    todo, seen = list(dists), set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        for req in importlib.metadata.requires(dist) or []:
            if not re.search(r"\bextra\s*==", req):
                todo.append(_norm(re.match(r"[A-Za-z0-9._-]+", req).group()))
    return seen


# Replaces sys.meta_path with one finder that answers "not found" for the top-level modules of
# every installed distribution outside the allowed ones, exactly as if they were not installed
# (a finder that raised instead would break code that probes with importlib.util.find_spec).
# The standard library and zerocompile itself are not installed distributions' modules here.
ONLY_ALLOWED = textwrap.dedent("""
    import json, sys
    hidden = set(json.loads(sys.argv[1]))
    blocked = set()

    class HideUndeclared:
        def __init__(self, finders):
            self.finders = finders

        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in hidden:
                blocked.add(top)
                return None
            for finder in self.finders:
                spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None:
                    return spec
            return None

        def invalidate_caches(self):
            for finder in self.finders:
                if hasattr(finder, "invalidate_caches"):
                    finder.invalidate_caches()

    sys.meta_path[:] = [HideUndeclared(list(sys.meta_path))]
""")

PLAIN_INSTALL = ONLY_ALLOWED + textwrap.dedent("""
    import pkgutil
    import zerocompile, zerocompile.cli
    for info in pkgutil.walk_packages(zerocompile.__path__, "zerocompile."):
        if not info.name.startswith("zerocompile.integrations."):   # those need the hf extra
            __import__(info.name)                # every other installed module imports
    assert not any(m.startswith("zerocompile.integrations.") for m in sys.modules), "imported integrations"
    print("blocked:", sorted(blocked), file=sys.stderr)
    try:
        zerocompile.cli.main(["--help"])
    except SystemExit as exc:
        sys.exit(exc.code)
    sys.exit(3)                                  # --help must exit through argparse
""")


def _hidden_modules(allowed_dists: set) -> list:
    """Top-level modules of installed distributions outside ``allowed_dists`` (stdlib excluded)."""
    providers = importlib.metadata.packages_distributions()
    return sorted(name for name, owners in providers.items()
                  if name not in sys.stdlib_module_names and name != "zerocompile"
                  and not any(_norm(o) in allowed_dists for o in owners))


def _run_plain(hidden: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PLAIN_INSTALL, json.dumps(hidden)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_plain_install_runs_zerocompile_help(tmp_path):
    base, _ = _declared()
    hidden = _hidden_modules(_closure(base))
    assert "pytest" in hidden                   # installed here, but not by a plain install
    proc = _run_plain(hidden, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: zerocompile") and "dump" in proc.stdout and "show" in proc.stdout


def test_the_import_blocker_blocks(tmp_path):
    """The check above can fail: with rich hidden too, the command line does not import."""
    base, _ = _declared()
    proc = _run_plain(_hidden_modules(_closure(base)) + ["rich"], tmp_path)
    assert proc.returncode == 1 and "No module named 'rich'" in proc.stderr, proc.stderr[-3000:]
