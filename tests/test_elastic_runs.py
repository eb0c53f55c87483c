"""Real runs on CPU slots where the scheduler changes a running flotilla: a model restarts on more
slots (fleet_e), a model on its plateau gives a slot to one whose loss still falls (fleet_e with
scheduler.phase_threshold), a waiting model joins a running stream (fleet_l with scheduler.join_running)."""
import threading

import pytest

from pipeline.orchestration.driver import Driver, EpochBoundary
from pipeline.run import run
from pipeline.scheduler import Join
from pipeline.training.rates import Pace
from tests.conftest import compose_config, resnet_override
from tests.test_run import small

pytestmark = pytest.mark.slow

def fixed_rates(monkeypatch, rates):
    """The rate table the scheduler plans with, instead of measuring: the plan is then known."""
    monkeypatch.setattr("pipeline.training.rates.measure_rates", lambda group, slot_counts, how, abandon=None:
                        {g: Pace(rates[group.name][g - 1], 0.0) for g in slot_counts})


# Two models: slow is a ResNet made wide, so it takes longer than fast; with two slots each starts on
# one, and slow still has epochs to go when fast is done and its slot idles. Rates as a GPU host
# measures them (two slots faster than one; on this machine's 2 cores two CPU slots train slower than
# one, so fleet_e would rightly never grow a model here).
TWO_MODELS = (f"ensemble.models=[{resnet_override('slow', width=64)}, "
              f"{resnet_override('fast', 'alt', 16)}]")
GROW_RATES = {"slow": (100.0, 190.0), "fast": (110.0, 200.0)}


def test_a_model_restarts_on_the_idle_slot_and_its_accuracy_curve_carries_on(tiny_dataset, tmp_path, monkeypatch):
    fixed_rates(monkeypatch, GROW_RATES)
    cfg = compose_config(small(tiny_dataset, TWO_MODELS, "scheduler=fleet_e", "trainer.slots=2", "trainer.epochs=6",
                               "scheduler.patience=0", f"rates.cache={tmp_path / 'rate_cache.json'}"))
    results = run(cfg, tmp_path / "out")
    decisions = results["scheduler"]["decisions"]
    formed = [d["members"] for d in decisions if d["decision"] == "FormFlotilla"]
    # longest first, one slot each, each with its own stream; then slow again on both slots
    assert formed == ["{'slow': 1}", "{'fast': 1}", "{'slow': 2}"], formed
    (resized,) = [d for d in decisions if d["decision"] == "Stop" and d["reason"] == "resized"]
    models = {m["name"]: m for m in results["models"]}
    for model in models.values():
        assert model["epochs"] == 6 and model["converged"]
        assert len(model["val_accuracy"]) == 6  # one validation per epoch, none lost or repeated
    slow = models["slow"]
    assert resized["group"] == "slow" and [len(s["devices"]) for s in slow["flotillas"]] == [1, 2]
    restart = slow["flotillas"][1]["start_epoch"]  # resumed from the epoch it had finished, not from scratch
    assert 0 < restart < 6 and slow["train_loss"][restart] < slow["train_loss"][0]
    # on 2 slots its two trainers are one data-parallel model, each on half of every batch (the world the
    # scheduler gave it, not the config's 1 slot): it still trains on each image once an epoch
    per_epoch = slow["flotillas"][0]["images"] / restart
    assert slow["flotillas"][1]["images"] == per_epoch * (6 - restart)


# Seed 003's older and younger task on three slots of one node. old's learning rate is so small that its
# loss is level from its first epoch (it moves by a few percent either way: the augmentation), so the loss
# rule reads it as on its plateau; young, a ResNet made wide (its epochs take longer), still cuts its loss
# by a third or more an epoch (measured: 35-45% in its epochs 2-4, in every try). Both gain from a
# second slot (GPU-like rates), old most, so fleet_e starts old on two slots and young on one.
PHASE_MODELS = (f"ensemble.models=[{resnet_override('old', width=16, lr=0.0001)}, "
                f"{resnet_override('young', 'alt', 64, lr=0.01)}]")
PHASE_RATES = {"old": (100.0, 190.0, 270.0), "young": (100.0, 150.0, 190.0)}
THRESHOLD = 0.1


def loss_drop(model, epoch):
    """The fraction of its training loss `model` (results) removed in `epoch` (1-based)."""
    before, after = model["train_loss"][epoch - 2], model["train_loss"][epoch - 1]
    return (before - after) / before


def test_a_model_on_its_plateau_gives_a_slot_to_one_whose_loss_still_falls(tiny_dataset, tmp_path, monkeypatch):
    fixed_rates(monkeypatch, PHASE_RATES)
    cfg = compose_config(small(tiny_dataset, PHASE_MODELS, "scheduler=fleet_e", "trainer.slots=3",
                               "trainer.epochs=6", "scheduler.patience=0", f"scheduler.phase_threshold={THRESHOLD}",
                               f"rates.cache={tmp_path / 'rate_cache.json'}"))
    results = run(cfg, tmp_path / "out")
    decisions = results["scheduler"]["decisions"]
    restarts = [(d["group"], d["reason"]) for d in decisions if d["decision"] == "Stop" and d["reason"] != "converged"]
    assert restarts == [("old", "plateau"), ("young", "resized")], restarts
    models = {m["name"]: m for m in results["models"]}
    old, young = models["old"], models["young"]
    assert [len(s["devices"]) for s in old["flotillas"]] == [2, 1]
    assert [len(s["devices"]) for s in young["flotillas"]] == [1, 2]
    # each restarted from the checkpoint of the epoch it finished, where the rule read its loss: old's fell
    # by less than the threshold (its first drop); young's, read at whichever epoch it had reached when old
    # gave up (how fast each trains decides that), put it on no plateau: unknown after its first epoch (no
    # drop to read yet), or above the threshold
    gave_up, grew = old["flotillas"][1]["start_epoch"], young["flotillas"][1]["start_epoch"]
    assert gave_up == 2 and loss_drop(old, gave_up) < THRESHOLD
    assert 1 <= grew < 6 and (grew == 1 or loss_drop(young, grew) >= THRESHOLD)
    for model in models.values():
        assert model["epochs"] == 6 and model["converged"] and len(model["val_accuracy"]) == 6
    # young's curve carries on from its checkpoint on two slots: its loss stays below its first epoch's, and it
    # trains on each image once an epoch (its two trainers are one data-parallel model)
    assert max(young["train_loss"][grew:]) < young["train_loss"][0]
    per_epoch = young["flotillas"][0]["images"] / grew
    assert young["flotillas"][1]["images"] == per_epoch * (6 - grew)
    # the run's Gantt chart: young's second stint holds a slot of old's first, and no slot is held twice at once
    gantt = results["scheduler"]["gantt"]
    held = lambda model, flotilla: {tuple(b["slot"]) for b in gantt if (b["group"], b["flotilla"]) == (model, flotilla)}
    assert sorted((b["group"], b["flotilla"]) for b in gantt) == [
        ("old", 0), ("old", 0), ("old", 2), ("young", 1), ("young", 3), ("young", 3)]
    # one of them beside old's second stint; both (assign_slots takes a node's lowest free slots) when old had
    # finished before young grew (seen with the cores busy: old trained all its epochs while young was in its
    # second)
    old_done = next(b["end"] for b in gantt if (b["group"], b["flotilla"]) == ("old", 2)) <= next(
        b["start"] for b in gantt if (b["group"], b["flotilla"]) == ("young", 3))
    assert len(held("young", 3) & held("old", 0)) == (2 if old_done else 1)
    bars = sorted((tuple(b["slot"]), b["start"], b["end"]) for b in gantt)
    for (slot, _, end), (next_slot, start, _) in zip(bars, bars[1:]):
        assert slot != next_slot or end <= start


# Two slots train slower than one (as on this machine's 2 cores): every flotilla starts on one slot.
# resnet10_w24 forms flotilla 0, densenet40_k8 flotilla 1 on the other slot; when resnet10_w24 is done, the
# joiner, of like rate (190 against 200), joins flotilla 1's stream instead of forming its own.
# densenet40_k12 reads the stream's input (alt): its trainer attaches to the running hub's ring; resnet10_w16
# reads main, which the hub does not make: the flotilla is laid out again with it.
JOIN_RATES = {"resnet10_w24": (300.0, 250.0), "densenet40_k8": (200.0, 160.0)}
JOINERS = {"densenet40_k12": ("attached", "resnet10_w16"), "resnet10_w16": ("laid out again", "densenet40_k12")}


def hold_the_host_for_its_joiner(monkeypatch):
    """Flotilla 1 waits at its first epoch boundary until the scheduler sends it a joiner: the host then
    still has epochs to go when resnet10_w24 is done, however fast each trains here."""
    sent = threading.Event()
    apply_decisions, apply_commands = Driver._apply_decisions, EpochBoundary.apply

    def decide(driver, decisions):
        apply_decisions(driver, decisions)
        if any(isinstance(d, Join) for d in decisions):
            sent.set()

    def wait_at_the_boundary(boundary, flotilla, epoch):
        if boundary.flotilla_id == 1 and epoch == 1:
            assert sent.wait(timeout=300), "no model joined flotilla 1 within 300 s"
        apply_commands(boundary, flotilla, epoch)

    monkeypatch.setattr(Driver, "_apply_decisions", decide)
    monkeypatch.setattr(EpochBoundary, "apply", wait_at_the_boundary)


@pytest.mark.parametrize("joiner_name", JOINERS)
def test_a_waiting_model_joins_a_running_stream_at_its_next_epoch_boundary(joiner_name, tiny_dataset, tmp_path,
                                                                          monkeypatch):
    how, other = JOINERS[joiner_name]
    fixed_rates(monkeypatch, {**JOIN_RATES, joiner_name: (190.0, 150.0), other: (100.0, 80.0)})
    hold_the_host_for_its_joiner(monkeypatch)
    cfg = compose_config(small(tiny_dataset, "scheduler=fleet_l", "scheduler.join_running=true", "trainer.slots=2",
                               "trainer.epochs=4", "scheduler.patience=0",
                               f"rates.cache={tmp_path / 'rate_cache.json'}"))
    results = run(cfg, tmp_path / "out")
    decisions = results["scheduler"]["decisions"]
    (join,) = [d for d in decisions if d["decision"] == "Join"]
    assert (join["group"], join["flotilla"]) == (joiner_name, "1")
    models = {m["name"]: m for m in results["models"]}
    for model in models.values():
        assert model["epochs"] == 4 and model["converged"] and len(model["val_accuracy"]) == 4
    host, joiner = models["densenet40_k8"], models[joiner_name]
    assert [s["flotilla"] for s in host["flotillas"]] == [1] and joiner["flotillas"][0]["flotilla"] == 1
    # it joined the stream at the boundary the host was held at (once the host is done, fleet_l's
    # min_active_fraction stops the flotilla, and the joiner goes on in another)
    stint = joiner["flotillas"][0]
    assert stint["flotilla_epoch"] == 1 and stint["start_epoch"] == 0 and stint["joined"] == how
    # the host trained on (attached: untouched; laid out again: from the checkpoint of the epoch it had
    # finished): its loss goes on, and it trained on each image once an epoch, as resnet10_w24 did alone
    assert host["train_loss"][stint["flotilla_epoch"]] < host["train_loss"][0]
    assert host["flotillas"][0]["images"] == models["resnet10_w24"]["flotillas"][0]["images"]
    (stream,) = results["delivery"]["flotillas"]["1"]["streams"]
    assert sorted(stream["members"]) == sorted(["densenet40_k8", joiner_name])
