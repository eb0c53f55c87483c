"""The GPU memory trial's bookkeeping (pipeline/training/memory.py): which models are tried, what the
cache keeps, and what the memory check does with a peak. The trial itself needs CUDA: tests/test_gpu.py."""
import json
from dataclasses import replace

import pytest

from pipeline.orchestration.devices import SlotError
from pipeline.orchestration.group_plan import (ModelSize, check_group_memory, check_host_memory, group_bytes,
                                             measure_sizes, with_measured_peaks)
from pipeline.training import memory
from pipeline.training.group import GroupSpec
from pipeline.training.rates import Measurement, Pace, measure_rate_table
from pipeline.training.rates import RateError
from tests.conftest import member

HOW = Measurement(num_classes=4, image_sizes={"main": 32}, batch_size=16, device_kind="cpu", devices=["cpu"], steps=1,
                  warmup=0, threads=1)


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
    """A grid of learning rates (or weight decays) weighs one model's peak; SGD without momentum keeps no
    buffer, so it is tried apart; the cache answers the next run. Mistakes it catches: a trial per member
    (a sweep of 100 rates tries 100 models), a cache key that holds the learning rate, one blind to the
    optimiser's settings, a cache that is not read back."""
    cache = tmp_path / "rates.json"
    models = [member("a", lr=0.1), member("b", lr=0.01, weight_decay=1e-3), member("wide", width=16),
              replace(member("plain"), optimizer={**member("plain").optimizer, "momentum": 0, "nesterov": False})]
    assert memory.measure_peaks(models, HOW, cache) == {"a": 8 * 2**20, "b": 8 * 2**20, "wide": 16 * 2**20,
                                                         "plain": 8 * 2**20}
    assert trials == ["a", "wide", "plain"]
    assert memory.measure_peaks([member("c", lr=0.5), member("wide", width=16)], HOW, cache) == \
        {"c": 8 * 2**20, "wide": 16 * 2**20}
    assert trials == ["a", "wide", "plain"]


def test_a_peak_sits_beside_the_rates_of_the_same_model(trials, tmp_path, monkeypatch):
    """One entry per model in the rate cache: rates measured later land beside its peak, and the peak
    survives them. A separate key (or a rate measurement that rewrites the entry) fails."""
    from pipeline.training import rates

    cache = tmp_path / "rates.json"
    m = member("a")
    memory.measure_peaks([m], HOW, cache)
    monkeypatch.setattr(rates, "measure_rates",
                        lambda group, counts, how, abandon=None: {k: Pace(50.0, 0.0) for k in counts})
    measure_rate_table([GroupSpec("a", (m,))], 1, HOW, cache)
    [entry] = json.loads(cache.read_text())
    assert entry["images_per_s"] == {"1": 50.0} and entry["peak_allocated_bytes"] == 8 * 2**20
    assert memory.measure_peaks([m], HOW, cache) == {"a": 8 * 2**20} and trials == ["a"]


def test_the_memory_check_refuses_a_model_whose_measured_step_does_not_fit():
    """The estimate of a small model fits a slot; its measured peak (activations, workspaces, graphs)
    does not, and the check says so. A peak added on top of the estimate, or ignored, fails one side."""
    m = member("a")
    sizes = measure_sizes([m], 4, {"main": 32}, 16, "cuda")
    estimate = sizes["a"].state_bytes + sizes["a"].activation_bytes
    slot = 5 * estimate  # x1.5 headroom: 4.5 estimates fit
    check_group_memory([GroupSpec("a", (m,))], sizes, slot)
    fits = with_measured_peaks(sizes, {"a": 3 * estimate})
    assert group_bytes(GroupSpec("a", (m,)), fits) == 3 * estimate + sizes["a"].kept_on_slot_bytes  # and a copy
    check_group_memory([GroupSpec("a", (m,))], fits, slot)
    with pytest.raises(SlotError, match="model a needs about"):
        check_group_memory([GroupSpec("a", (m,))], with_measured_peaks(sizes, {"a": slot}), slot)


def test_a_fused_array_holds_one_workspace_and_each_members_activations():
    """What a trial measures beyond a model's state and estimated activations (cuBLAS's and cuDNN's
    workspaces, the graphs' pool) is the process's: a fused array of k members holds it once, their
    activations k times; packed, one member's activations at a time; each member's state, and its copy
    kept from the epoch's end, always. Hand-counted: state 100, its copy 60, activations 1000, a measured
    peak of 1600 leaves a workspace of 500. Counting the peak's surplus once per member (k workspaces), the
    activations once, or a copy once, fails."""
    members = (member("a", lr=0.1), member("b", lr=0.01), member("c", lr=0.001))
    sizes = {m.name: ModelSize(0, 100, 1000, 0.0, kept_copy_bytes=60) for m in members}
    measured = with_measured_peaks(sizes, {m.name: 1600 for m in members})
    assert group_bytes(GroupSpec("g", members, 3), measured) == 300 + 180 + 3000 + 500
    assert group_bytes(GroupSpec("g", members), measured) == 300 + 180 + 1000 + 500


def test_a_slot_counts_the_kept_copies_of_a_models_state_it_holds():
    """A trainer keeps each member's state from its last KEPT_EPOCHS epochs' ends (trainer._keep_states). A
    GPU slot holds one copy, until the checkpoint writer has moved it to host memory; a CPU slot's memory is
    host memory, and holds them all. A copy is the parameters, buffers and optimiser state: no gradients."""
    from pipeline.training.members import build_module, optimizer_state_bytes
    from pipeline.training.models import kept_state_bytes
    from pipeline.training.trainer import KEPT_EPOCHS

    m = member("a")
    one = kept_state_bytes(build_module(m, 4, 32), optimizer_state_bytes(m, build_module(m, 4, 32)))
    on_gpu, on_cpu = (measure_sizes([m], 4, {"main": 32}, 16, kind)["a"] for kind in ("cuda", "cpu"))
    assert on_gpu.kept_copy_bytes == on_cpu.kept_copy_bytes == one
    assert (on_gpu.kept_on_slot_bytes, on_cpu.kept_on_slot_bytes) == (one, KEPT_EPOCHS * one) == (one, 2 * one)
    assert group_bytes(GroupSpec("a", (m,)), {"a": on_cpu}) - group_bytes(GroupSpec("a", (m,)), {"a": on_gpu}) == one


def test_a_gpu_hosts_memory_must_hold_the_kept_copies_of_the_groups_that_train_at_once():
    """On GPU slots the kept copies are in host memory: KEPT_EPOCHS of each member's, for the largest groups
    that can train at once (one per slot). Hand-counted, kept copies of 10 and 100 bytes, x1.5 headroom:
    groups of 1, 2 and 3 members of 100 and one of 10 on 2 slots need 2 x (300 + 200) x 1.5 = 1500 bytes.
    Counting every group, one epoch's copy, or the smallest groups, fails a side."""
    members = [member(f"m{i}") for i in range(7)]
    sizes = {m.name: ModelSize(0, 0, 0, 0.0, kept_copy_bytes=100) for m in members[:6]} | \
        {"m6": ModelSize(0, 0, 0, 0.0, kept_copy_bytes=10)}
    groups = [GroupSpec("one", tuple(members[:1])), GroupSpec("two", tuple(members[1:3])),
              GroupSpec("three", tuple(members[3:6])), GroupSpec("small", tuple(members[6:]))]
    check_host_memory(groups, sizes, 2, 1500)
    with pytest.raises(SlotError, match=r"2 GPU slot\(s\) keep each model's state from its last 2 epochs' ends in "
                                        r"host memory.*about 0.00 GiB.*ensemble.models"):
        check_host_memory(groups, sizes, 2, 1499)
    check_host_memory(groups, sizes, 4, 2 * 610 * 1.5)
    with pytest.raises(SlotError):
        check_host_memory(groups, sizes, 4, 2 * 610 * 1.5 - 1)


def runs_out_of_memory(m, how, *, to_parent, from_parent):
    """In the trial's child: the real trial on a stand-in GPU of 80 GiB whose first step raises what
    torch's CUDA allocator raises."""
    from types import SimpleNamespace

    import torch

    def step(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                          "capacity of 79.19 GiB\nof which 1.2 GiB is free.")

    torch.cuda.set_device = lambda device: None
    torch.cuda.get_device_properties = lambda device: SimpleNamespace(total_memory=80 * 2**30)
    memory.GroupStep = step
    memory._try(m, how, to_parent=to_parent, from_parent=from_parent)


def test_a_model_that_runs_out_of_memory_alone_is_told_in_one_line(monkeypatch):
    """A model whose step alone does not fit the GPU is the user's to fix (a smaller batch or model): a
    one-line error naming it, the device's size, the batch and the fixes, with the allocator's first line;
    not a traceback (an out-of-memory error reported as any other failure fails)."""
    monkeypatch.setattr(memory, "_try", runs_out_of_memory)
    with pytest.raises(RateError) as raised:
        memory._trial(member("a"), HOW)
    assert str(raised.value) == (
        "model a ran out of GPU memory training alone on cpu (80.0 GiB) with pipeline.batch_size=16: lower "
        "pipeline.batch_size, make the model smaller, use trainer.precision=bf16, or free the GPU of other "
        "processes (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB)")
