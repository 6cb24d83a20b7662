"""Build and load the C++ kernels in ``csrc/`` on first use.

``load(name)`` compiles ``csrc/<name>.cpp`` with ``torch.utils.cpp_extension.load`` (ninja,
the C++ compiler torch uses, ``-O3 -march=native -fopenmp``) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``; a rebuild happens only
when the source or the flags change), and returns the module. The compiler is given a copy of
the source at a path named by its content (``stable_source``), not the file in the package:
torch's build file records the source's path, so a moved or re-cloned checkout on the same
environment would otherwise rebuild the extension (half a minute on two cores). The build file
also records the environment's torch headers: two virtual environments still share torch's
build directory for the extension and rebuild it whenever the other one built last. Where the build cannot run (no
compiler, no ninja, a compile error), it logs one warning naming the cause and returns None;
callers then use torch's own kernels. ``ZEROCOMPILE_CPP_KERNELS=0`` skips the build.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("zerocompile")

CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp")
"""``-march=native``: the loops are vectorized for the build machine's widest vector unit
(AVX-512, AVX2, ...); the extension cache lives on that machine. ``-fno-math-errno`` lets
``sqrt`` vectorize (it no longer sets ``errno``; its results are the same).
``-ffp-contract=off``: every multiply and add rounds on its own, as in torch's kernels."""
LDFLAGS = ("-fopenmp",)
DISABLE_ENV = "ZEROCOMPILE_CPP_KERNELS"


def stable_source(name: str) -> Path:
    """A copy of ``csrc/<name>.cpp`` at a path that depends only on its content:
    ``$XDG_CACHE_HOME/zerocompile/csrc/<sha256>/<name>.cpp`` (``~/.cache`` by default)."""
    text = (importlib.resources.files("zerocompile.csrc") / f"{name}.cpp").read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "zerocompile" / "csrc" / hashlib.sha256(text).hexdigest()[:16] / f"{name}.cpp"
    if not path.is_file() or path.read_bytes() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_bytes(text)
        os.replace(partial, path)           # atomic: a concurrent build never reads half a file
    return path


@functools.cache
def load(name: str):
    """The built extension ``csrc/<name>.cpp``, or None (logged once) where it cannot be built."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("zerocompile: C++ kernels disabled by %s=0; using torch's kernels", DISABLE_ENV)
        return None
    started = time.monotonic()
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(name=f"zerocompile_{name}", sources=[str(stable_source(name))],
                                     extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False)
    except Exception as err:  # noqa: BLE001 - any build failure means: use the fallback
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning("zerocompile: could not build the C++ kernel csrc/%s.cpp (%s: %s); using torch's "
                    "kernels instead. Install a C++ compiler and ninja (pip install ninja) to get it, "
                    "or set %s=0 to silence this", name, type(err).__name__, first_line, DISABLE_ENV)
        return None
    log.info("zerocompile: loaded C++ kernel csrc/%s.cpp in %.1f s", name, time.monotonic() - started)
    return module
