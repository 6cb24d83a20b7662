"""``python -m zerocompile ...``: the same command line as ``zerocompile ...`` (zerocompile/cli/)."""

from zerocompile.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
