"""What a ring collective costs: the one definition the planner, the simulator, the HLO reader and
local SGD's byte count all use (plain Python: the training path may import it).

Over K devices with ring algorithms each device sends, of an array of S bytes (S unsharded):
all-reduce 2(K-1)/K x S (a reduce-scatter, K-1 steps, then an all-gather, K-1 steps), all-gather,
reduce-scatter and all-to-all (K-1)/K x S; every step moves S/K bytes and pays one latency.
"""
from __future__ import annotations

RING_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def ring_steps(kind: str, k: int) -> int:
    """Neighbour-to-neighbour steps of one ring collective over k devices."""
    if kind not in RING_KINDS:
        raise ValueError(f"no ring formula for {kind!r}")
    if k <= 1:
        return 0
    return 2 * (k - 1) if kind == "all-reduce" else k - 1


def bus_factor(kind: str, k: int) -> float:
    """Bytes one device sends per byte of the unsharded array: 2(K-1)/K or (K-1)/K."""
    passes = ring_steps(kind, 2)  # rings around the devices: 2 for an all-reduce, 1 for the others
    return passes * (k - 1) / k if k > 1 else 0.0


def ring_seconds(kind: str, size: float, k: int, bw: float, lat: float) -> float:
    """Time of one ring collective of `size` bytes over k devices: every step latency + S/K / bandwidth."""
    return ring_steps(kind, k) * lat + bus_factor(kind, k) * size / bw
