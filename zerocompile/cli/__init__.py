"""The ``zerocompile`` command line (also ``python -m zerocompile``).

``zerocompile dump [--out DIR] [--world-size N] [--options JSON] -- SCRIPT [ARGS...]``
    runs a training script with graph dumping on (``ZEROCOMPILE_DUMP=DIR``) and summarises
    what was recorded. With ``--world-size N`` the script runs in this process on torch's
    fake process group of N ranks (this process is rank 0), so the graphs of an N-rank job
    can be dumped on one machine.

``zerocompile show DIR [--rank R] [--frame F] [--graph G] [--after PASS] [--diff PASS]
[--svg OUT.svg] [--memory OUT.png]``
    prints, per frame and graph, a table of the pipeline's steps (nodes, collectives,
    simulated peak memory, pass time), a step's code, a diff across one pass, a graphviz
    drawing or a plot of simulated live memory.

``zerocompile consolidate CKPT_DIR OUT``
    reads a checkpoint written by ``zerocompile.save_checkpoint`` (no process group needed) and
    writes the full model state dict to one file: ``torch.save`` format, or safetensors when
    OUT ends in ``.safetensors``.

``zerocompile plan --world-size N [--options JSON] [--hardware NAME|FILE] [--json] [--compare]
-- SCRIPT [ARGS...]``
    runs SCRIPT on N fake ranks with fake tensors and reports per rank its memory,
    communication and estimated step time.

``zerocompile tune --world-size N [--hardware NAME|FILE] [--memory-limit-gb G] [--options JSON]
[--out DIR] [--json] [--verify K] [--jobs J] -- SCRIPT [ARGS...]``
    plans SCRIPT at N ranks with one configuration after another and reports the fastest whose
    peak fits the memory limit, with the runners-up and why each lost.

Bad arguments and paths are one-line errors on stderr with exit code 2; a missing optional
tool (graphviz, matplotlib) is a one-line error with exit code 1. See docs/cli.md.

One module per subcommand (``dump``, ``show``, ``consolidate``, ``plan``, ``tune``: each adds its parser
with ``add_parser(subparsers)`` and runs as ``cmd_<name>(args)``); ``inputs`` reads and checks
what they are given, ``render`` draws tables, DOT graphs and plots, ``errors`` holds
``CliError``. This module builds the parser and runs the command.
"""

from __future__ import annotations

import argparse
import sys

from zerocompile.cli import consolidate, dump, plan, show, tune
from zerocompile.cli.errors import CliError
from zerocompile.cli.inputs import read_dump
from zerocompile.cli.render import graph_to_dot, human_bytes, write_memory_plot, write_svg

__all__ = ["CliError", "build_parser", "graph_to_dot", "human_bytes", "main", "read_dump", "write_memory_plot",
           "write_svg"]

SUBCOMMANDS = (dump, show, consolidate, plan, tune)


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (a ``CliError``), not usage + error."""

    def error(self, message):
        raise CliError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The ``zerocompile`` argument parser (subcommands ``dump``, ``show``, ``consolidate``, ``plan``, ``tune``)."""
    from zerocompile import __version__

    parser = _Parser(prog="zerocompile", description="Debugging tools for the zerocompile torch.compile backend.")
    parser.add_argument("--version", action="version", version=f"zerocompile {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="{dump,show,consolidate,plan,tune}", parser_class=_Parser)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


def _split_script(argv: list) -> tuple:
    """For ``dump``, ``plan`` and ``tune``: everything after the first ``--`` is the script and its
    arguments, kept out of argparse (whose handling of ``--`` before a remainder varies
    between versions)."""
    if argv and argv[0] in ("dump", "plan", "tune") and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, None


def main(argv: list | None = None) -> int:
    """Run the command line; return the exit code (``zerocompile`` calls ``sys.exit`` with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        head, tail = _split_script(argv)
        args = parser.parse_args(head)
        if args.subcommand is None:
            parser.print_help(sys.stderr)
            return 2
        if tail is not None:
            args.command = list(args.command) + tail
        return args.func(args)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
