"""Which rank owns each parameter of a whole-parameter optimizer (Muon, Adafactor, ...).

The owner of a parameter holds that parameter's optimizer state (the only copy) and runs the
user's optimizer on the whole matrix once per step. Owners are chosen from the parameters'
sizes alone, so every rank computes the same assignment without communicating: largest first,
each to the rank holding the fewest elements so far (ties to the lowest rank). That is greedy
list scheduling, so no rank holds more than ``total / world`` elements plus one parameter's:
the optimizer state per rank is ``1/N`` of the total within one matrix's size.
"""

from __future__ import annotations


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """The owner rank of each parameter, given each one's number of elements ``sizes`` (in a
    fixed order, the same on every rank) and the number of ranks ``world``."""
    if world < 1:
        raise ValueError(f"assign_owners: world must be >= 1, got {world}")
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


def owner_loads(sizes: list[int], owners: list[int], world: int) -> list[int]:
    """Elements owned by each rank."""
    load = [0] * world
    for size, owner in zip(sizes, owners):
        load[owner] += size
    return load
