"""Graph passes of zerocompile (installed as ``zerocompile.passes``): one pass per file."""
