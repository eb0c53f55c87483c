"""Rate measurement: short real DDP runs on CPU slots (gloo), the on-disk
cache, the rate table and the errors. Behaviour only: nothing here asserts speed."""
import json
import os
import signal
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pipeline.runtime.child import Child
from pipeline.runtime.lifetime import children_context
from pipeline.scheduler import RateTable
from pipeline.training import rates as rate_measurement
from pipeline.training.group import GroupSpec, StepInHand
from pipeline.training.rates import (HostHardware, Measured, MeasuredBy, Measurement, Pace, RateError, StepTimes,
                                     format_table, measure_rate_table, measure_rates, measure_side_by_side, pace,
                                     save_table)
from tests.conftest import member

TINY = member("tiny")
DENSE = member("dense", arch="densenet", depth=16, width=16, growth_rate=8)


def alone(model):
    return GroupSpec(model.name, (model,))


def how(**changes):
    settings = dict(num_classes=4, image_sizes={"main": 32}, batch_size=16, device_kind="cpu",
                    devices=["cpu", "cpu"], steps=2, warmup=1, threads=1)
    return Measurement(**(settings | changes))


def measure_tiny(group=alone(TINY), slot_counts=(1, 2), **changes):
    return measure_rates(group, list(slot_counts), how(**changes))


def test_a_rate_is_the_whole_batch_over_the_median_step_of_the_slowest_rank_and_a_start_the_warmups_excess():
    """Two ranks' timed steps: the steps take 0.25, 0.5 and 0.2 s (the slower rank's), median 0.25 s, so
    16 images make 64 images/s. Rank 0's steps alone (128), the mean step (50.5), the median of all
    durations or of the slower rank's (80), images per ms, or a rank's share of the batch (32) fail.
    Their two warm-up steps take 10 and 0.3 s (the slower rank's): 9.8 s beyond two steps at the rate's
    pace. Rank 0's alone (8.8), the whole warm-up (10.3) or one step's excess (9.75) fail."""
    reports = [StepTimes(0, [9.0, 0.3], [0.1, 0.5, 0.125]), StepTimes(1, [10.0, 0.2], [0.25, 0.2, 0.2])]
    assert pace(16, reports) == Pace(64, pytest.approx(9.8))
    assert pace(16, [StepTimes(0, [0.1], [0.25, 0.25])]).start_s == 0  # a warm-up as fast as the pace


class Clock:
    """Stands in for the time module in rates: time passes only when the test says."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.mark.parametrize("before_replay", [0, 4])
def test_a_rank_reports_the_time_inside_each_timed_step(monkeypatch, before_replay):
    """A rank run in this process, with steps of known cost: 1000 s pass between steps, the warmup step
    trains for 100 s, the timed ones for 1, 2 and 3 s, and normalising a batch (part of a step, as in the
    trainer) takes 0.5 s. It reports 1.5, 2.5 and 3.5 s, and 100.5 s untimed. A group whose steps become
    replayed CUDA graphs only after `steps_before_replay` steps (the eager ones and the capture, 50 s
    each) has that many more untimed steps. A timed warmup step, a timed capture, or a clock running
    between steps, fails."""
    import torch

    clock, training = Clock(), iter([100] + [50] * before_replay + [1, 2, 3])

    class Step:
        def __init__(self, *args, **kwargs):
            self.steps_before_replay = before_replay

        def normalise(self, images):
            clock.now += 0.5
            return images

        def train(self, batches):
            clock.now += next(training)

    class InHand:
        def begin(self, step):
            clock.now += 1000

    monkeypatch.setattr(rate_measurement, "GroupStep", Step)
    monkeypatch.setattr(rate_measurement, "time", clock)
    monkeypatch.setattr(rate_measurement, "child_started", lambda role: None)  # keeps this process's signals
    reports = []
    # threads: this process's own count, which the rank sets
    rate_measurement._train_steps(alone(TINY), 0, ["cpu"], "", how(devices=["cpu"], steps=3, warmup=1,
                                                                   threads=torch.get_num_threads()),
                                  InHand(), False, to_parent=SimpleNamespace(send=reports.append), from_parent=None)
    assert reports == [StepTimes(0, [100.5] + [50.5] * before_replay, [1.5, 2.5, 3.5])]


class Parent:
    """A measured process's end of its parent's pipe: it says stop after `polls` looks, and records them."""

    def __init__(self, polls):
        self.polls, self.looks = polls, []

    def poll(self, timeout=0.0):
        self.looks.append(timeout)
        return timeout is None or len(self.looks) > self.polls


@pytest.mark.parametrize("stop_after, steps_after_report",
                         [(3, 3), (10_000, 4 * rate_measurement.BUSY_STEPS_FACTOR - 4)])
def test_a_process_measured_side_by_side_reports_then_steps_on_until_told(monkeypatch, stop_after, steps_after_report):
    """Side by side, a process reports its timed steps, then keeps training (its device stays shared for the
    others still timing) until its parent says stop: 3 steps when told after 3 looks. Told never, it steps
    at most BUSY_STEPS_FACTOR times its own steps, then waits for the word (poll without a timeout) rather
    than end. Ending at its report, stepping before it, or stepping forever, fails."""
    events = []

    class Step:
        steps_before_replay = 0

        def __init__(self, *args, **kwargs):
            pass

        def normalise(self, images):
            return images

        def train(self, batches):
            events.append("step")

    monkeypatch.setattr(rate_measurement, "GroupStep", Step)
    monkeypatch.setattr(rate_measurement, "child_started", lambda role: None)
    parent = Parent(stop_after)
    rate_measurement._train_steps(alone(TINY), 0, ["cpu"], "", how(devices=["cpu"], steps=3, warmup=1), StepInHand(
        children_context(), alone(TINY), 4), True, to_parent=SimpleNamespace(send=lambda r: events.append("report")),
        from_parent=parent)
    assert events == ["step"] * 4 + ["report"] + ["step"] * steps_after_report
    assert parent.looks[-1] is None and all(t == 0.0 for t in parent.looks[:-1])


@pytest.mark.slow
def test_groups_side_by_side_are_measured_at_once_at_the_slowest_ones_rate_and_cached(monkeypatch, tmp_path):
    """Two models in two processes on one CPU slot (sub-slots): each reports its own steps; the pace is the
    slower one's rate and the longer start (a flotilla steps at its slowest member's pace). The cache entry
    names both members whatever the order and the names, so a second call, the groups swapped and renamed,
    starts no process. The faster one's rate, or an entry per order, fails."""
    reported, side_by_side = [], rate_measurement._side_by_side_steps

    def record(groups, how):
        reported.append(side_by_side(groups, how))
        return reported[-1]

    monkeypatch.setattr(rate_measurement, "_side_by_side_steps", record)
    cache, settings = tmp_path / "rates.json", how(devices=["cpu"], steps=3)
    measured = measure_side_by_side([alone(TINY), alone(DENSE)], settings, cache)
    [reports] = reported
    assert sorted((len(r.warmup), len(r.seconds)) for r in reports) == [(1, 3), (1, 3)]
    paces = [pace(16, [r]) for r in reports]
    assert measured == Pace(min(p.images_per_s for p in paces), max(p.start_s for p in paces))
    swapped = [alone(replace(DENSE, name="d2")), alone(replace(TINY, name="t2"))]
    assert measure_side_by_side(swapped, settings, cache) == measured and len(reported) == 1
    [entry] = json.loads(cache.read_text())
    assert len(entry["key"]["side_by_side"]) == 2 and entry["images_per_s"] == {"2": measured.images_per_s}


def measure_and_record(monkeypatch, slot_counts, **changes):
    """measure_tiny's rates, and what each run's ranks reported (slot count -> each rank's step durations)."""
    by_run, rank_reports = {}, rate_measurement._rank_reports

    def record(ranks, *args):
        by_run[len(ranks)] = rank_reports(ranks, *args)
        return by_run[len(ranks)]

    monkeypatch.setattr(rate_measurement, "_rank_reports", record)
    return measure_tiny(slot_counts=slot_counts, **changes), by_run


@pytest.mark.slow
def test_rates_are_images_per_second_of_the_timed_steps_on_one_and_two_cpu_slots(monkeypatch):
    """Each rank of a run reports its 4 timed steps (the warmup step left out), and the run's rate is the
    whole batch over them (the rule: test_a_rate_is_the_whole_batch_over_the_median_step_of_the_slowest_rank).
    A timed warmup step, or a rank's share of the batch, fails."""
    rates, reported = measure_and_record(monkeypatch, [1, 2], steps=4)
    assert {slots: [(len(r.warmup), len(r.seconds)) for r in ranks] for slots, ranks in reported.items()} == \
        {1: [(1, 4)], 2: [(1, 4), (1, 4)]}
    assert rates == {slots: pace(16, ranks) for slots, ranks in reported.items()}


@pytest.mark.gpu
@pytest.mark.slow
def test_rates_on_gpus_with_nccl(monkeypatch):
    """As on CPU slots, over NCCL: each rank of a run reports its 2 timed steps, and the run's rate is the
    whole batch over them. A timed warmup step, or a rank's share of the batch, fails."""
    import torch

    slot_counts = list(range(1, min(torch.cuda.device_count(), 2) + 1))
    rates, reported = measure_and_record(monkeypatch, slot_counts, device_kind="cuda",
                                         devices=[f"cuda:{i}" for i in range(len(slot_counts))])
    assert {slots: [len(r.seconds) for r in ranks] for slots, ranks in reported.items()} == \
        {slots: [2] * slots for slots in slot_counts}
    assert rates == {slots: pace(16, ranks) for slots, ranks in reported.items()}


@pytest.fixture
def measured(monkeypatch) -> list[tuple[str, list[int]]]:
    """Stands in for the real runs: records (model, slot counts) of each
    measurement and returns 100 images/s per slot."""
    calls = []

    def fake_measure(group, slot_counts, how, abandon=None):
        calls.append((group.name, slot_counts))
        return {k: Pace(100.0 * k, 0.0) for k in slot_counts}

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
    wider = replace(TINY, model=TINY.model | {"width": 16})
    rate_table([TINY, wider], cache)
    rate_table([TINY], cache, threads=2)
    assert measured == [("tiny", [1, 2]), ("tiny", [1, 2]), ("tiny", [1, 2])]
    assert len(json.loads(cache.read_text())) == 3


def test_only_missing_slot_counts_are_measured_and_names_do_not_matter(measured, tmp_path):
    cache = tmp_path / "rates.json"
    rate_table([TINY], cache)
    renamed_sweep_member = replace(TINY, name="tiny-lr0.01", optimizer=TINY.optimizer | {"lr": 0.01})
    table = rate_table([renamed_sweep_member], cache, max_slots=3)
    assert measured == [("tiny", [1, 2]), ("tiny-lr0.01", [3])]
    assert table.rates == {"tiny-lr0.01": (100.0, 200.0, 300.0)}


class FarHost:
    """A RateHost standing in for a node agent's host (pipeline/orchestration/agent.py: AgentRates):
    other hardware, another process. Records what it was asked to measure."""

    def __init__(self, gpus: int = 0):
        self.calls = []
        self.gpus = gpus

    def hardware(self, how):
        return HostHardware({"device_kind": how.device_kind, "device_name": "far-cpu", "cores": 64,
                             "threads": how.threads, "torch": "far"}, MeasuredBy("far", 4242))

    def measure(self, group, slot_counts, how):
        self.calls.append((group.name, slot_counts, how.devices))
        return Measured({k: Pace(10.0 * k, 0.0) for k in slot_counts}, MeasuredBy("far", 4242))


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
    table.add("resnet10", [100, 190, 270], 23.5)
    table.add("densenet40", [40, 75])
    text = format_table(table)
    for expected in ["resnet10", "densenet40", "1 slot", "2 slots", "3 slots", "190.0 (1.90x)", "75.0 (1.88x)",
                     "start s", "23.5"]:
        assert expected in text
    save_table(table, tmp_path / "out" / "rates.json")
    saved = json.loads((tmp_path / "out" / "rates.json").read_text())
    assert saved == {"resnet10": {"images_per_s": {"1": 100, "2": 190, "3": 270}, "start_s": 23.5},
                     "densenet40": {"images_per_s": {"1": 40, "2": 75}, "start_s": 0.0}}


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
    sweep = [replace(TINY, name=f"t{i}", optimizer=TINY.optimizer | {"lr": 0.1 / (i + 1)}) for i in range(3)]
    packed = rate_table(sweep, cache, fuse=False)
    fused = rate_table(sweep, cache, fuse=True)
    renamed = [replace(m, name=m.name + "-again") for m in sweep]
    rate_table(renamed, cache, fuse=True)
    assert measured == [("group0", [1]), ("group0", [1])]
    assert packed.rates == fused.rates == {"group0": (100.0,)}
    with pytest.raises(RateError, match="group group0 holds one slot"):
        measure_tiny(GroupSpec("group0", tuple(sweep), 3), slot_counts=[1, 2])


def test_a_model_without_image_size_or_a_corrupt_cache_is_a_clear_error(measured, tmp_path):
    alt = replace(DENSE, input="alt")
    with pytest.raises(RateError, match="no image size for sink 'alt' of model 'dense'"):
        measure_rate_table([alone(alt)], 1, how(), tmp_path / "rates.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    with pytest.raises(RateError, match="corrupt.json is not valid JSON.*delete it"):
        rate_table([TINY], corrupt)


@pytest.mark.slow
def test_a_failing_trainer_process_is_reported_with_its_traceback():
    bad_depth = replace(TINY, name="resnet11", model=TINY.model | {"depth": 11})
    with pytest.raises(RuntimeError, match=r"(?s)measuring resnet11 \(.*\) on 1 slot.*resnet depth must be one of"):
        measure_tiny(alone(bad_depth), slot_counts=[1])


def _die_by(signum, *, to_parent, from_parent):
    os.kill(os.getpid(), signum)


@pytest.mark.slow
@pytest.mark.parametrize("signum, says", [
    (signal.SIGABRT, r"crashed \(SIGABRT\): a native library .* failed inside it; run again with PYTHONFAULTHANDLER=1"),
    (signal.SIGSEGV, r"crashed \(SIGSEGV\): a native library"),
    (signal.SIGKILL, r"was killed \(SIGKILL\): usually the kernel's out-of-memory killer")])
def test_a_rank_that_dies_is_named_with_how_it_died_and_what_it_trained(signum, says):
    """A measuring rank that dies without a report: its signal's usual cause and the next step, and the
    models it trained. The mistake it catches: every death called "out of memory?" (oneDNN's SIGABRT was)."""
    rank = Child(_die_by, (signum,), "rates-tiny-0")
    rank.stop(60)  # it ends by its own signal long before
    with pytest.raises(RuntimeError, match=r"measuring tiny \(tiny \(resnet\(depth=10, width=8\)\)\) on 1 slot\(s\): "
                                           f"rates-tiny-0 {says}"):
        in_hand = StepInHand(children_context(), alone(TINY), how().steps)
        rate_measurement._rank_reports([rank], [in_hand], f"tiny ({alone(TINY).describe()}) on 1 slot(s)", how(),
                                       None)


@pytest.mark.slow
def test_a_rank_that_hangs_is_named_with_the_step_it_is_on():
    """A rank with no report by timeouts.report_s (here: far too many steps for it) is named with the model
    and the step it was on when the wait ended (inside tiny's step, or between two). The mistake it catches:
    a message that says neither."""
    with pytest.raises(RuntimeError, match=r"measuring tiny \(tiny \(resnet\(depth=10, width=8\)\)\) on 1 slot\(s\): "
                                           r"no report in 15 s \(timeouts.report_s\): rates-tiny-0 at step \d+ of "
                                           r"1000001, (in the step of tiny|between members' steps);"):
        measure_tiny(slot_counts=[1], steps=1_000_000, report_s=15)
