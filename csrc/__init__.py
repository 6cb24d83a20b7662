"""C++ sources of zerocompile's CPU kernels, built on first use by
``zerocompile.runtime.cpu_extension`` (installed as package data of ``zerocompile.csrc``)."""
