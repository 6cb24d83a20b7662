"""Every environment variable zerocompile reads, in one leaf module.

Each variable has its name here and one function that reads and checks it; the rest of the
package calls the function (or, to set a variable for a child process, uses the name). Nothing
here imports the package, so every layer may read its input from here.

=========================== ====================================================================
``ZEROCOMPILE_OPTIONS``     a JSON object of backend options that override the script's
                            (set by ``zerocompile dump --options`` for the script it launches)
``ZEROCOMPILE_DUMP``        directory for graph dumps when the ``dump`` option is not set
``ZEROCOMPILE_PROGRESS``    ``1`` forces progress bars, ``0`` turns them off
``ZEROCOMPILE_CPP_KERNELS`` ``0`` turns the C++ CPU kernels off (torch's kernels run instead)
``TRITON_INTERPRET``        ``1``: Triton kernels run on CPU tensors in Triton's interpreter
``XDG_CACHE_HOME``          root of the C++ extension cache (default ``~/.cache``)
=========================== ====================================================================
"""

from __future__ import annotations

import json
import os
from pathlib import Path

OPTIONS_ENV = "ZEROCOMPILE_OPTIONS"
DUMP_ENV = "ZEROCOMPILE_DUMP"
PROGRESS_ENV = "ZEROCOMPILE_PROGRESS"
CPP_KERNELS_ENV = "ZEROCOMPILE_CPP_KERNELS"
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


def options_override() -> dict | None:
    """The JSON object in ``ZEROCOMPILE_OPTIONS``, or None when it is unset or empty.
    Raises ``ValueError`` naming the variable when it is not a JSON object."""
    text = os.environ.get(OPTIONS_ENV)
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"environment variable {OPTIONS_ENV} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"environment variable {OPTIONS_ENV} must hold a JSON object, e.g. '{{\"stage\": 3}}'")
    return value


def dump_dir() -> str | None:
    """``ZEROCOMPILE_DUMP``, or None when it is unset or empty."""
    return os.environ.get(DUMP_ENV) or None


def progress_setting() -> bool | None:
    """``ZEROCOMPILE_PROGRESS``: True for ``1``, False for ``0``, None otherwise (decide from
    the terminal)."""
    setting = os.environ.get(PROGRESS_ENV, "").strip()
    return setting == "1" if setting in ("0", "1") else None


def cpp_kernels_disabled() -> bool:
    """Whether ``ZEROCOMPILE_CPP_KERNELS=0`` turns the C++ CPU kernels off."""
    return os.environ.get(CPP_KERNELS_ENV, "1") == "0"


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET=1`` runs Triton kernels in the interpreter (on CPU tensors)."""
    return os.environ.get(TRITON_INTERPRET_ENV) == "1"


def cache_root() -> Path:
    """Where zerocompile caches what it builds (the C++ extension)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerocompile"
