"""The GPU memory trial's bookkeeping (pipeline/training/memory.py): which models are tried, what the
cache keeps, and what the memory check does with a peak. The trial itself needs CUDA: tests/test_gpu.py."""
import json

import pytest

from pipeline.orchestration.devices import SlotError
from pipeline.orchestration.grouping import check_group_memory, measure_sizes, with_measured_peaks
from pipeline.training import memory
from pipeline.training.group import GroupSpec
from pipeline.training.rates import Measurement, measure_rate_table
from tests.conftest import member

HOW = Measurement(4, {"main": 32}, 16, "cpu", ["cpu"], 1, 0, 1)


@pytest.fixture
def trials(monkeypatch) -> list[str]:
    """Stands in for the trial's child: records the models tried, and gives each 1 MB per unit of width."""
    tried = []

    def trial(m, how):
        tried.append(m.name)
        return m.model["width"] * 2**20

    monkeypatch.setattr(memory, "_trial", trial)
    return tried


def test_models_that_differ_only_in_rate_are_tried_once_and_a_second_run_tries_none(trials, tmp_path):
    """A grid of learning rates weighs one model's peak; the cache answers the next run. Mistakes it
    catches: a trial per member (a sweep of 100 rates tries 100 models), a cache key that holds the
    learning rate, a cache that is not read back."""
    cache = tmp_path / "rates.json"
    models = [member("a", lr=0.1), member("b", lr=0.01), member("wide", width=16)]
    assert memory.measure_peaks(models, HOW, cache) == {"a": 8 * 2**20, "b": 8 * 2**20, "wide": 16 * 2**20}
    assert trials == ["a", "wide"]
    assert memory.measure_peaks([member("c", lr=0.5), member("wide", width=16)], HOW, cache) == \
        {"c": 8 * 2**20, "wide": 16 * 2**20}
    assert trials == ["a", "wide"]


def test_a_peak_sits_beside_the_rates_of_the_same_model(trials, tmp_path, monkeypatch):
    """One entry per model in the rate cache: rates measured later land beside its peak, and the peak
    survives them. A separate key (or a rate measurement that rewrites the entry) fails."""
    from pipeline.training import rates

    cache = tmp_path / "rates.json"
    m = member("a")
    memory.measure_peaks([m], HOW, cache)
    monkeypatch.setattr(rates, "measure_rates", lambda group, counts, how, abandon=None: {k: 50.0 for k in counts})
    measure_rate_table([GroupSpec("a", (m,))], 1, HOW, cache)
    [entry] = json.loads(cache.read_text())
    assert entry["images_per_s"] == {"1": 50.0} and entry["peak_allocated_bytes"] == 8 * 2**20
    assert memory.measure_peaks([m], HOW, cache) == {"a": 8 * 2**20} and trials == ["a"]


def test_the_memory_check_refuses_a_model_whose_measured_step_does_not_fit():
    """The estimate of a small model fits a slot; its measured peak (activations, workspaces, graphs)
    does not, and the check says so. A peak added on top of the estimate, or ignored, fails one side."""
    m = member("a")
    sizes = measure_sizes([m], 4, {"main": 32}, 16)
    estimate = sizes["a"].state_bytes + sizes["a"].activation_bytes
    slot = 5 * estimate  # x1.5 headroom: 4.5 estimates fit
    check_group_memory([GroupSpec("a", (m,))], sizes, slot)
    fits = with_measured_peaks(sizes, {"a": 3 * estimate})
    assert fits["a"].state_bytes + fits["a"].activation_bytes == 3 * estimate
    check_group_memory([GroupSpec("a", (m,))], fits, slot)
    with pytest.raises(SlotError, match="model a needs about"):
        check_group_memory([GroupSpec("a", (m,))], with_measured_peaks(sizes, {"a": slot}), slot)
