"""Check that every rank compiled the same sequence of collectives for a frame.

A rank whose graph issues collectives in another order, kind, dtype or size than its
peers hangs the job (or silently mixes up buffers). At the first run of each compiled
frame, before any of the frame's own collectives, the ranks all-gather a 60-bit hash of
the frame's collective sequences (forward, then backward). If the hashes differ, the
ranks all-gather the sequences themselves (encoded as integers) and raise an error on
every rank that names the first collective that differs, what each group of ranks has
there, and the ranks involved.
"""

from __future__ import annotations

import hashlib

import torch

from zerocompile.runtime.accounting import COLLECTIVE_KINDS
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.comm import CommGroup, all_gather_flat, is_fake_group

_DTYPES = ("", "float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")


def fingerprint(sequences) -> int:
    """A rank-independent 60-bit hash of ``[(kind, dtype, bytes), ...]`` lists."""
    digest = hashlib.sha256(repr([list(seq) for seq in sequences]).encode()).hexdigest()
    return int(digest[:15], 16)


def _encode(sequences: list[list]) -> list[int]:
    """One int64 triple per collective: graph index, kind * 16 + dtype, bytes."""
    out = []
    for g, seq in enumerate(sequences):
        for kind, dtype, nbytes in seq:
            k = COLLECTIVE_KINDS.index(kind) if kind in COLLECTIVE_KINDS else 15
            d = _DTYPES.index(dtype) if dtype in _DTYPES else 15
            out.extend([g, k * 16 + d, nbytes])
    return out


def _describe(triple, graph_names) -> str:
    if triple is None:
        return "no collective (its sequence ended)"
    g, kd, nbytes = triple
    kind = COLLECTIVE_KINDS[kd // 16] if kd // 16 < len(COLLECTIVE_KINDS) else "other"
    dtype = _DTYPES[kd % 16] if kd % 16 < len(_DTYPES) else "other"
    return f"{kind} of {nbytes} bytes ({dtype or 'unknown dtype'}) in the {graph_names[g]} graph"


def first_difference(per_rank: list[list[int]], graph_names) -> str:
    """The first position where the ranks' encoded sequences differ, described."""
    triples = [[tuple(seq[i:i + 3]) for i in range(0, len(seq), 3)] for seq in per_rank]
    length = max(len(t) for t in triples)
    for i in range(length):
        at = [t[i] if i < len(t) else None for t in triples]
        if len(set(at)) > 1:
            groups: dict = {}
            for rank, value in enumerate(at):
                groups.setdefault(value, []).append(rank)
            parts = [f"ranks {ranks} have {_describe(value, graph_names)}" for value, ranks in groups.items()]
            return f"collective #{i} differs: " + "; ".join(parts)
    return "the sequences hash differently but compare equal"


def check_same_on_all_ranks(value: int, group: CommGroup, what: str, sequences=None,
                            graph_names=("forward", "backward"), device=None, session=None) -> None:
    """All-gather ``value`` over ``group``; raise, naming the first differing collective
    of ``sequences`` when given, if any rank holds another one. ``device``: where the
    group's collectives run (the parameters' device; CPU for gloo); ``session``: the model's
    ``ModelSession`` that counts the all-gather (None: counted outside any model)."""
    if group.world == 1 or is_fake_group(group):
        return
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    values = all_gather_flat(mine, group.world, group.name).tolist()
    (session or PROCESS.outside).record("all_gather", 8 * group.world)
    differing = [rank for rank, v in enumerate(values) if v != values[0]]
    if not differing:
        return
    detail = f"rank 0 differs from ranks {differing}"
    if sequences is not None:
        encoded = _encode([list(s) for s in sequences])
        length = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
        lengths = all_gather_flat(length, group.world, group.name).tolist()
        padded = torch.zeros(max(lengths), dtype=torch.int64, device=device)
        padded[: len(encoded)] = torch.tensor(encoded, dtype=torch.int64)
        rows = all_gather_flat(padded, group.world, group.name).view(group.world, -1).tolist()
        detail = first_difference([row[:n] for row, n in zip(rows, lengths)], graph_names)
    raise RuntimeError(
        f"zerocompile: ranks compiled different collective sequences for {what}: {detail}. "
        "Every rank must run the same model code with the same options and input shapes "
        "(set ZEROCOMPILE_DUMP=DIR and compare the ranks' graphs with `zerocompile show DIR --rank R`)")
