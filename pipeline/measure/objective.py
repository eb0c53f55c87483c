"""The run's objective: the one number `python -m pipeline` returns to Hydra, which a sweeper that
optimises (Optuna's, Nevergrad's, Ax's) reads as the trial's value. `objective.of` names whose value
(the ensemble, the best member, or one member by name) and `objective.metric` which one; the
sweeper's direction must match the metric's (Metric.direction)."""
from __future__ import annotations

import enum
import math

ENSEMBLE = "ensemble"
BEST_MEMBER = "best_member"


class Metric(enum.StrEnum):
    val_accuracy = "val_accuracy"  # share of validation images right: higher is better
    val_loss = "val_loss"  # cross-entropy of the validation softmax: lower is better

    @property
    def direction(self) -> str:
        """Optuna's word for it (hydra.sweeper.direction)."""
        return "maximize" if self is Metric.val_accuracy else "minimize"

    def best(self, values: list[float]) -> float:
        """The best of `values`, leaving out a NaN (a diverged member's loss), which max and min return or
        not by where it stands; NaN when every one is."""
        values = [value for value in values if not math.isnan(value)] or [math.nan]
        return max(values) if self is Metric.val_accuracy else min(values)


def objective_value(results: dict, of: str, metric: Metric) -> float | None:
    """`metric` of `of` in a training run's results; None when it validated nothing to say it.

    A member's value is that of its best epoch (the highest accuracy or the lowest loss); the best
    member's, the best of those; the ensemble's, that of the ensemble the run leaves in checkpoints/
    (each member's best checkpoint), or of its members' last epochs while some member has no checkpoint."""
    if of == ENSEMBLE:
        ensemble = results["ensemble"]
        value = (ensemble["kept"] or {}).get(metric, ensemble[f"final_{metric}"])
    else:
        members = [m for m in results["models"] if of in (BEST_MEMBER, m["name"])]
        values = [metric.best(m[metric]) for m in members if m[metric]]
        value = metric.best(values) if values else None
    return None if value is None or math.isnan(value) else value


def objective_record(results: dict, objective) -> dict:
    """results.json's "objective": what the run returns (`objective`, the config's objective node) and what it
    measures, whose direction the sweep summary ranks jobs by."""
    return {"of": objective.of, "metric": objective.metric, "direction": objective.metric.direction,
            "value": objective_value(results, objective.of, objective.metric)}
