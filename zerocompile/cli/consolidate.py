"""``zerocompile consolidate CKPT_DIR OUT``: a checkpoint written by
``zerocompile.save_checkpoint`` (no process group needed), written as the full model state
dict to one file: ``torch.save`` format, or safetensors when OUT ends in ``.safetensors``."""

from __future__ import annotations

import os

from zerocompile.cli.errors import CliError


def add_parser(subparsers) -> None:
    consolidate = subparsers.add_parser(
        "consolidate", help="write a checkpoint's full model state dict to one file",
        description="Read a checkpoint directory written by zerocompile.save_checkpoint (any world size, "
                    "any stage) and write the full model state dict, keys and shapes of the uncompiled "
                    "model.state_dict(), to OUT: torch.save format, or safetensors when OUT ends in "
                    ".safetensors.")
    consolidate.add_argument("checkpoint", metavar="CKPT_DIR", help="a checkpoint directory")
    consolidate.add_argument("out", metavar="OUT", help="output file (.pt, .bin, ... or .safetensors)")
    consolidate.set_defaults(func=cmd_consolidate)


def cmd_consolidate(args) -> int:
    """``zerocompile consolidate CKPT_DIR OUT``."""
    from zerocompile.checkpoint import write_consolidated

    if os.path.isdir(args.out):
        raise CliError(f"zerocompile consolidate: error: {args.out} is a directory; OUT is the file to write")
    try:
        state = write_consolidated(args.checkpoint, args.out)
    except ImportError as err:
        raise CliError(f"zerocompile consolidate: error: {err}", code=1) from None
    except (FileNotFoundError, ValueError) as err:
        message = str(err).removeprefix("zerocompile: ")
        raise CliError(f"zerocompile consolidate: error: {message}") from None
    tensors = {id(t): t for t in state.values()}.values()
    numel = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"wrote {args.out}: {len(state)} entries, {numel:,} elements, {nbytes / 2**20:.1f} MiB")
    return 0
