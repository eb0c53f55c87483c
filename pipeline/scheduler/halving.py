"""Successive halving inside a run (scheduler.halving): at each rung, min_epochs x eta^k epochs, the
members that reached it are ranked by a validation metric there (the objective's), and all but the best
ceil(n / eta) stop training: they are culled, their last checkpoint kept, and their slots go back to the
scheduler as a converged group's do. Under FLEET members reach a rung at different times (flotillas one
after another): each is judged as it reaches the rung, against every member that has reached it so far
(ASHA's rule, Li et al., MLSys 2020); under scheduler=shared, where all train in lockstep, a rung is
judged once, on all of them. Judged from the members' recorded metrics alone, it keeps no state of its
own: a resumed run judges as the run it continues."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Halving:
    eta: int  # 1 / eta of a rung's members go on (>= 2)
    min_epochs: int  # the first rung
    metric: str  # what ranks them: val_accuracy or val_loss
    higher_is_better: bool

    def is_rung(self, epochs: int) -> bool:
        rung = self.min_epochs
        while rung < epochs:
            rung *= self.eta
        return rung == epochs

    def culled(self, reached: list[str], metrics: dict[str, list[float]]) -> dict[str, str]:
        """Of the members in `reached` (each has just validated an epoch), those culled, and why.
        `metrics`: every member's metric by epoch, its first epoch's first."""
        culled = {}
        for member in reached:
            epochs = len(metrics[member])
            if not self.is_rung(epochs):
                continue
            rung = {name: values[epochs - 1] for name, values in metrics.items() if len(values) >= epochs}
            sign = -1 if self.higher_is_better else 1
            # best first, a NaN (a diverged member's loss) last; ties by name
            order = sorted(rung, key=lambda name: (math.isnan(rung[name]), sign * rung[name], name))
            kept, rank = math.ceil(len(order) / self.eta), order.index(member) + 1
            if rank > kept:
                culled[member] = (f"culled at epoch {epochs}: {self.metric} {rung[member]:.4g} ranks {rank} of "
                                  f"{len(order)}, the best {kept} go on (scheduler.halving.eta={self.eta})")
        return culled
