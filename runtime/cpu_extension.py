"""Build and load the C++ kernels in ``csrc/`` on first use.

``load(name)`` compiles ``csrc/<name>.cpp`` with ``torch.utils.cpp_extension.load`` (ninja,
the C++ compiler torch uses, ``-O3 -march=native -fopenmp``) and returns the module. Each build
lives in its own folder, ``$XDG_CACHE_HOME/zerocompile/build/<key>`` (``~/.cache`` by default),
named by everything the binary depends on (``build_key``): the source's bytes, the flags, the
torch version and C++ ABI, the Python version and this machine's CPU (``-march=native``). A
folder holding a finished build (its ``complete`` marker written after the first successful
load) is imported directly, without asking torch's builder: torch's build file records the
paths of the source and of the environment's torch headers, so every fresh checkout or
virtual environment would otherwise compile again (half a minute on two cores), although the
binary would be the same. Where the build cannot run (no compiler, no ninja, a compile error),
it logs one warning naming the cause and returns None; callers then use torch's own kernels.
``ZEROCOMPILE_CPP_KERNELS=0`` skips the build.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path

from zerocompile import env

log = logging.getLogger("zerocompile")

CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp")
"""``-march=native``: the loops are vectorized for the build machine's widest vector unit
(AVX-512, AVX2, ...); the extension cache lives on that machine. ``-fno-math-errno`` lets
``sqrt`` vectorize (it no longer sets ``errno``; its results are the same).
``-ffp-contract=off``: every multiply and add rounds on its own, as in torch's kernels."""
LDFLAGS = ("-fopenmp",)
DISABLE_ENV = env.CPP_KERNELS_ENV


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU model and feature flags (Linux), else the
    machine and processor names."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def build_key(name: str) -> str:
    """The name of ``name``'s build folder: a hash of the source's bytes, the compile and link
    flags, torch's version and C++ ABI, the Python version and the CPU. Two environments with
    the same of all these share one build; a change to any of them builds afresh."""
    import torch

    source = (importlib.resources.files("zerocompile.csrc") / f"{name}.cpp").read_bytes()
    parts = [source, repr((CFLAGS, LDFLAGS, torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI,
                           sys.version_info[:2], sys.implementation.name, _cpu_identity())).encode()]
    return f"{name}-" + hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def stable_source(name: str) -> Path:
    """A copy of ``csrc/<name>.cpp`` at a path that depends only on its content:
    ``$XDG_CACHE_HOME/zerocompile/csrc/<sha256>/<name>.cpp`` (``~/.cache`` by default)."""
    text = (importlib.resources.files("zerocompile.csrc") / f"{name}.cpp").read_bytes()
    path = env.cache_root() / "csrc" / hashlib.sha256(text).hexdigest()[:16] / f"{name}.cpp"
    if not path.is_file() or path.read_bytes() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_bytes(text)
        os.replace(partial, path)           # atomic: a concurrent build never reads half a file
    return path


def _import_built(module_name: str, library: Path):
    """Import the extension module of a finished build (what torch's loader does after it built)."""
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load(name: str):
    """The built extension ``csrc/<name>.cpp``, or None (logged once) where it cannot be built."""
    if env.cpp_kernels_disabled():
        log.info("zerocompile: C++ kernels disabled by %s=0; using torch's kernels", DISABLE_ENV)
        return None
    started = time.monotonic()
    module_name = f"zerocompile_{name}"
    try:
        import torch  # noqa: F401 - the extension links against the torch already loaded
        from torch.utils import cpp_extension

        folder = env.cache_root() / "build" / build_key(name)
        marker = folder / "complete"       # holds the library's file name, written after a good load
        library = folder / marker.read_text().strip() if marker.is_file() else None
        if library is not None and library.is_file():
            module = _import_built(module_name, library)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            module = cpp_extension.load(name=module_name, sources=[str(stable_source(name))],
                                         extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                         build_directory=str(folder), verbose=False)
            partial = folder / f"complete.{os.getpid()}.tmp"
            partial.write_text(f"{Path(module.__file__).name}\n")
            os.replace(partial, marker)     # atomic: another process reads all of it or none
    except Exception as err:  # noqa: BLE001 - any build failure means: use the fallback
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning("zerocompile: could not build the C++ kernel csrc/%s.cpp (%s: %s); using torch's "
                    "kernels instead. Install a C++ compiler and ninja (pip install ninja) to get it, "
                    "or set %s=0 to silence this", name, type(err).__name__, first_line, DISABLE_ENV)
        return None
    log.info("zerocompile: loaded C++ kernel csrc/%s.cpp in %.1f s", name, time.monotonic() - started)
    return module
