"""Rate measurement: short real DDP runs on CPU slots (gloo), the on-disk
cache, the rate table and the errors. Behaviour only: nothing here asserts speed."""
import json
import multiprocessing
import os
import signal
import time

import pytest

from pipeline.scheduler import RateTable
from pipeline.training import rates as rate_measurement
from pipeline.training.group import GroupSpec, ModelSpec, StepInHand
from pipeline.training.rates import (HostHardware, Measured, MeasuredBy, Measurement, RateError, format_table,
                                     measure_rate_table, measure_rates, save_table)

TINY = ModelSpec("tiny", "resnet", 10, 8, 0, 0.1, 0.9, 5e-4, 1, "main")
DENSE = ModelSpec("dense", "densenet", 16, 16, 8, 0.1, 0.9, 5e-4, 1, "main")


def alone(model):
    return GroupSpec(model.name, (model,))


def how(**changes):
    settings = dict(num_classes=4, image_sizes={"main": 32}, batch_size=16, device_kind="cpu",
                    devices=["cpu", "cpu"], steps=2, warmup=1, threads=1)
    return Measurement(**(settings | changes))


def measure_tiny(group=alone(TINY), slot_counts=(1, 2), **changes):
    return measure_rates(group, list(slot_counts), how(**changes))


@pytest.mark.slow
def test_rates_are_images_per_second_of_the_timed_steps_on_one_and_two_cpu_slots():
    """A rate is batch / median step, and the timed steps lie inside the call: a median step is at
    most twice the mean, so each rate is at least batch x steps / (2 x the call's seconds). A rate in
    the wrong unit (images per ms), or of the wrong quantity (a rank's share of the batch), fails."""
    started = time.perf_counter()
    rates = measure_tiny(steps=4)
    elapsed = time.perf_counter() - started
    assert set(rates) == {1, 2}
    for slots, rate in rates.items():
        assert 16 * 4 / (2 * elapsed) <= rate < float("inf"), (slots, rate, elapsed)


@pytest.mark.gpu
@pytest.mark.slow
def test_rates_on_gpus_with_nccl():
    import torch

    gpus = [f"cuda:{i}" for i in range(min(torch.cuda.device_count(), 2))]
    started = time.perf_counter()
    rates = measure_tiny(slot_counts=list(range(1, len(gpus) + 1)), device_kind="cuda", devices=gpus)
    elapsed = time.perf_counter() - started
    assert all(16 * 2 / (2 * elapsed) <= rate < float("inf") for rate in rates.values()), (rates, elapsed)


@pytest.fixture
def measured(monkeypatch) -> list[tuple[str, list[int]]]:
    """Stands in for the real runs: records (model, slot counts) of each
    measurement and returns 100 images/s per slot."""
    calls = []

    def fake_measure(group, slot_counts, how, abandon=None):
        calls.append((group.name, slot_counts))
        return {k: 100.0 * k for k in slot_counts}

    monkeypatch.setattr(rate_measurement, "measure_rates", fake_measure)
    return calls


def rate_table(models, cache_path, max_slots=2, threads=1, fuse=None):
    groups = [alone(m) for m in models] if fuse is None else [GroupSpec("group0", tuple(models), 3 if fuse else 1)]
    return measure_rate_table(groups, max_slots, how(devices=["cpu"] * max_slots, threads=threads), cache_path)


def test_second_call_reads_the_cache(measured, tmp_path):
    cache = tmp_path / "rates.json"
    first = rate_table([TINY, DENSE], cache)
    assert measured == [("tiny", [1, 2]), ("dense", [1, 2])]
    assert first.rates == {"tiny": (100.0, 200.0), "dense": (100.0, 200.0)}
    written = cache.read_text()
    assert rate_table([TINY, DENSE], cache).rates == first.rates
    assert len(measured) == 2 and cache.read_text() == written


def test_changed_model_config_or_hardware_is_measured_again(measured, tmp_path):
    cache = tmp_path / "rates.json"
    rate_table([TINY], cache)
    wider = ModelSpec(**(TINY.__dict__ | {"width": 16}))
    rate_table([TINY, wider], cache)
    rate_table([TINY], cache, threads=2)
    assert measured == [("tiny", [1, 2]), ("tiny", [1, 2]), ("tiny", [1, 2])]
    assert len(json.loads(cache.read_text())) == 3


def test_only_missing_slot_counts_are_measured_and_names_do_not_matter(measured, tmp_path):
    cache = tmp_path / "rates.json"
    rate_table([TINY], cache)
    renamed_sweep_member = ModelSpec(**(TINY.__dict__ | {"name": "tiny-lr0.01", "lr": 0.01}))
    table = rate_table([renamed_sweep_member], cache, max_slots=3)
    assert measured == [("tiny", [1, 2]), ("tiny-lr0.01", [3])]
    assert table.rates == {"tiny-lr0.01": (100.0, 200.0, 300.0)}


class FarHost:
    """A RateHost standing in for a node agent's host (pipeline/orchestration/node.py: AgentRates):
    other hardware, another process. Records what it was asked to measure."""

    def __init__(self, gpus: int = 0):
        self.calls = []
        self.gpus = gpus

    def hardware(self, how):
        return HostHardware({"device_kind": how.device_kind, "device_name": "far-cpu", "cores": 64,
                             "threads": how.threads, "torch": "far"}, MeasuredBy("far", 4242))

    def measure(self, group, slot_counts, how):
        self.calls.append((group.name, slot_counts, how.devices))
        return Measured({k: 10.0 * k for k in slot_counts}, MeasuredBy("far", 4242))


def test_rates_measured_elsewhere_are_keyed_on_that_hosts_hardware_and_name_who_measured(measured, tmp_path):
    """With `where` (a node agent's host), the measurement and the hardware of the cache key are that
    host's; the cache and `measured_by` name its process. The same model measured here is another
    entry, measured here, by this process."""
    import os
    import socket

    cache, far = tmp_path / "rates.json", FarHost()
    by_far, by_here = {}, {}
    table = measure_rate_table([alone(TINY)], 2, how(where=far), cache, by_far)
    assert far.calls == [("tiny", [1, 2], ["cpu", "cpu"])] and measured == []
    assert table.rates == {"tiny": (10.0, 20.0)}
    assert by_far == {"tiny": {"1": {"host": "far", "pid": 4242}, "2": {"host": "far", "pid": 4242}}}
    here = measure_rate_table([alone(TINY)], 2, how(), cache, by_here)
    assert measured == [("tiny", [1, 2])] and here.rates == {"tiny": (100.0, 200.0)}
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    assert by_here == {"tiny": {"1": me, "2": me}}
    entries = json.loads(cache.read_text())
    assert [e["key"]["device_name"] for e in entries][0] == "far-cpu" and len(entries) == 2
    # Read again from the cache: nothing measured, and the record still names who measured.
    again = {}
    measure_rate_table([alone(TINY)], 2, how(where=far), cache, again)
    assert len(far.calls) == 1 and again == by_far


def test_gpus_of_a_host_measuring_elsewhere_are_not_checked_here(measured, tmp_path):
    """This machine has no such GPUs, the far host has: the request goes there, unchecked here (whether
    they exist is for the far host to say: its `hardware`, which this stand-in does not check)."""
    far = FarHost()
    table = measure_rate_table([alone(TINY)], 2, how(device_kind="cuda", devices=["cuda:6", "cuda:7"], where=far),
                               tmp_path / "rates.json")
    assert far.calls == [("tiny", [1, 2], ["cuda:6", "cuda:7"])] and table.rates == {"tiny": (10.0, 20.0)}
    with pytest.raises(RateError, match="are not all visible GPUs"):  # here, they are checked
        measure_rate_table([alone(TINY)], 2, how(device_kind="cuda", devices=["cuda:6", "cuda:7"]),
                           tmp_path / "rates.json")


def test_table_lists_every_model_and_slot_count_with_speedups(tmp_path):
    table = RateTable()
    table.add("resnet10", [100, 190, 270])
    table.add("densenet40", [40, 75])
    text = format_table(table)
    for expected in ["resnet10", "densenet40", "1 slot", "2 slots", "3 slots", "190.0 (1.90x)", "75.0 (1.88x)"]:
        assert expected in text
    save_table(table, tmp_path / "out" / "rates.json")
    saved = json.loads((tmp_path / "out" / "rates.json").read_text())
    assert saved == {"resnet10": {"1": 100, "2": 190, "3": 270}, "densenet40": {"1": 40, "2": 75}}


@pytest.mark.parametrize("changes, message", [
    ({"slot_counts": [1, 3]}, "only 2 device(s) given"),
    ({"slot_counts": []}, "slot counts must be positive integers"),
    ({"slot_counts": [0]}, "slot counts must be positive integers"),
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"warmup": -1}, "warmup must be an integer >= 0, got -1"),
    ({"threads": 0}, "threads must be an integer >= 1, got 0"),
    ({"batch_size": 3}, "batch_size=3 is too small for 2 slots"),
    ({"devices": ["cpu", "cuda:0"]}, "are not all CPU slots"),
    ({"device_kind": "cuda", "devices": ["cuda:0", "cuda:0", "cuda:99"]}, "are not all visible GPUs"),
])
def test_bad_requests_are_clear_errors_before_any_run(changes, message):
    with pytest.raises(RateError) as error:
        measure_tiny(**changes)
    assert message in str(error.value)


def test_a_group_of_several_is_measured_on_one_slot_packed_and_fused_apart(measured, tmp_path):
    """A group's rate is its own cache entry (members' shapes, fusion), whatever the names: a second sweep
    of the same shapes reads it."""
    cache = tmp_path / "rates.json"
    sweep = [ModelSpec(**(TINY.__dict__ | {"name": f"t{i}", "lr": 0.1 / (i + 1)})) for i in range(3)]
    packed = rate_table(sweep, cache, fuse=False)
    fused = rate_table(sweep, cache, fuse=True)
    renamed = [ModelSpec(**(m.__dict__ | {"name": m.name + "-again"})) for m in sweep]
    rate_table(renamed, cache, fuse=True)
    assert measured == [("group0", [1]), ("group0", [1])]
    assert packed.rates == fused.rates == {"group0": (100.0,)}
    with pytest.raises(RateError, match="group group0 holds one slot"):
        measure_tiny(GroupSpec("group0", tuple(sweep), 3), slot_counts=[1, 2])


def test_a_model_without_image_size_or_a_corrupt_cache_is_a_clear_error(measured, tmp_path):
    alt = ModelSpec(**(DENSE.__dict__ | {"input": "alt"}))
    with pytest.raises(RateError, match="no image size for stream 'alt' of model 'dense'"):
        measure_rate_table([alone(alt)], 1, how(), tmp_path / "rates.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    with pytest.raises(RateError, match="corrupt.json is not valid JSON.*delete it"):
        rate_table([TINY], corrupt)


@pytest.mark.slow
def test_a_failing_trainer_process_is_reported_with_its_traceback():
    bad_depth = ModelSpec(**(TINY.__dict__ | {"name": "resnet11", "depth": 11}))
    with pytest.raises(RuntimeError, match="(?s)measuring resnet11 on 1 slot.*resnet depth must be one of"):
        measure_tiny(alone(bad_depth), slot_counts=[1])


def _die_by(signum):
    os.kill(os.getpid(), signum)


@pytest.mark.slow
@pytest.mark.parametrize("signum, says", [
    (signal.SIGABRT, r"crashed \(SIGABRT\): a native library .* failed inside it; run again with PYTHONFAULTHANDLER=1"),
    (signal.SIGSEGV, r"crashed \(SIGSEGV\): a native library"),
    (signal.SIGKILL, r"was killed \(SIGKILL\): usually the kernel's out-of-memory killer")])
def test_a_rank_that_dies_is_named_with_how_it_died_and_what_it_trained(signum, says):
    """A measuring rank that dies without a report: its signal's usual cause and the next step, and the
    models it trained. The mistake it catches: every death called "out of memory?" (oneDNN's SIGABRT was)."""
    context = multiprocessing.get_context("spawn")
    rank = context.Process(target=_die_by, args=(signum,), name="rates-tiny-0")
    rank.start()
    rank.join()
    with pytest.raises(RuntimeError, match=r"measuring tiny \(tiny \(resnet10, width 8\)\) on 1 slot\(s\): "
                                           f"rates-tiny-0 {says}"):
        in_hand = StepInHand(context, alone(TINY), how().steps)
        rate_measurement._next_report(context.Queue(), [rank], [in_hand], alone(TINY), how(), None)


@pytest.mark.slow
def test_a_rank_that_hangs_is_named_with_the_step_it_is_on():
    """A rank with no report by timeouts.report_s (here: far too many steps for it) is named with the model
    and the step it was on when the wait ended (inside tiny's step, or between two). The mistake it catches:
    a message that says neither."""
    with pytest.raises(RuntimeError, match=r"measuring tiny \(tiny \(resnet10, width 8\)\) on 1 slot\(s\): no "
                                           r"report in 20 s \(timeouts.report_s\): rates-tiny-0 at step \d+ of "
                                           r"1000001, (in the step of tiny|between members' steps);"):
        measure_tiny(slot_counts=[1], steps=1_000_000, report_s=20)
