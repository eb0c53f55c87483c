"""What the scheduler knows about the hardware and the groups: the cluster and
the rate table (training rate of each group on 1..k slots)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.runtime.errors import UserError


class PlacementError(UserError):
    """A slot request the cluster cannot meet; the message says which and the fix."""


@dataclass(frozen=True, order=True)
class Slot:
    """One GPU (or CPU device slot): slot `index` of node `node`."""

    node: int
    index: int

    def __str__(self) -> str:
        return f"n{self.node}s{self.index}"


@dataclass(frozen=True)
class Cluster:
    """`nodes` nodes of `slots_per_node` slots and `cores_per_node` CPU cores.

    `prep_seconds_per_image` is the CPU cost of preprocessing one image
    (core-seconds); 0 means the CPUs are never the bottleneck. The cores of a
    node are shared by the pipelines on it in proportion to the slots they
    hold, so each busy slot brings `prep_rate_per_slot` images/s of
    preprocessing to its pipeline. What each topology costs: `topology.py`.
    """

    nodes: int
    slots_per_node: int
    cores_per_node: int = 0
    prep_seconds_per_image: float = 0.0
    network_images_per_s: float = 0.0  # images/s a node can receive from the others; 0: not limited

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.slots_per_node < 1:
            raise ValueError(
                f"cluster needs at least one node and one slot per node, got "
                f"nodes={self.nodes}, slots_per_node={self.slots_per_node}; set both >= 1")
        if self.prep_seconds_per_image < 0 or (self.prep_seconds_per_image > 0 and self.cores_per_node < 1):
            raise ValueError(
                f"preprocessing cost {self.prep_seconds_per_image} core-s/image needs cores_per_node >= 1 "
                f"(got {self.cores_per_node}); set cores_per_node, or prep_seconds_per_image=0 for unlimited CPUs")

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(Slot(n, i) for n in range(self.nodes) for i in range(self.slots_per_node))

    @property
    def total_slots(self) -> int:
        return self.nodes * self.slots_per_node

    @property
    def prep_rate_per_slot(self) -> float:
        """Images/s that the cores belonging to one slot can preprocess."""
        if self.prep_seconds_per_image == 0:
            return float("inf")
        return self.cores_per_node / self.slots_per_node / self.prep_seconds_per_image


@dataclass
class RateTable:
    """Training rate (images/s) of each group on 1, 2, ..., k slots, and its start: the seconds its
    trainers take before they step at that rate (compiling, graph capture), paid whenever it starts.

    A rate of 0 marks a slot count the group cannot run on (e.g. it does not
    fit in one slot's memory). Rates beyond the slots of one node are ignored:
    a multi-slot group always stays within one node.
    """

    rates: dict[str, tuple[float, ...]] = field(default_factory=dict)
    starts: dict[str, float] = field(default_factory=dict)  # seconds; a group absent starts at once

    def add(self, group: str, rates: tuple[float, ...] | list[float], start_s: float = 0.0) -> None:
        rates = tuple(float(r) for r in rates)
        if not rates or any(r < 0 for r in rates) or max(rates) == 0:
            raise ValueError(
                f"rate table entry of group {group!r} must list its images/s on 1, 2, ... slots with at least "
                f"one positive rate, got {rates}")
        if not start_s >= 0:
            raise ValueError(f"group {group!r}'s start must be seconds >= 0, got {start_s}")
        self.rates[group] = rates
        self.starts[group] = float(start_s)

    def start(self, group: str) -> float:
        return self.starts.get(group, 0.0)

    def rate(self, group: str, slots: int) -> float:
        table = self.rates[group]
        return table[slots - 1] if 1 <= slots <= len(table) else 0.0

    def slot_counts(self, group: str, slots_per_node: int) -> list[int]:
        """Slot counts the group can run on within one node."""
        return [g for g in range(1, slots_per_node + 1) if self.rate(group, g) > 0]

    def check_fits(self, cluster: Cluster) -> None:
        for group in self.rates:
            if not self.slot_counts(group, cluster.slots_per_node):
                raise PlacementError(
                    f"group {group!r} has no positive training rate on 1..{cluster.slots_per_node} slots "
                    f"(rates {self.rates[group]}), but a group must fit in one node of "
                    f"{cluster.slots_per_node} slots; measure it on fewer slots or use nodes with more slots")
