"""fleet_e in a real run on CPU slots: a model restarts on more slots mid-run and trains on."""
import pytest

from pipeline.run import run
from tests.conftest import compose_config
from tests.test_run import small

pytestmark = pytest.mark.slow

# Rates as a GPU host measures them (two slots faster than one). On this machine's 2 cores two CPU slots
# train slower than one, so fleet_e would rightly never grow a model: the table is fixed to fix the plan.
# The ResNets are the slowest here, so they start first; resnet10_w16, made wider, takes longer in fact than
# resnet10_w24, whose slot densenet40_k8 takes; the last, densenet40_k12, starts on resnet10_w16's slot, and
# still has epochs to go when densenet40_k8's slot idles.
RATES = {"resnet10_w16": (100.0, 190.0), "resnet10_w24": (110.0, 200.0),
         "densenet40_k8": (300.0, 560.0), "densenet40_k12": (320.0, 600.0)}


def test_a_model_restarts_on_the_idle_slot_and_its_accuracy_curve_carries_on(tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.training.rates.measure_rates",
                        lambda group, slot_counts, how: {g: RATES[group.name][g - 1] for g in slot_counts})
    cfg = compose_config(small(tiny_dataset, "scheduler=fleet_e", "trainer.slots=2", "trainer.epochs=4",
                               "scheduler.patience=0", "ensemble.models.0.width=64", f"rates.cache={tmp_path / 'rate_cache.json'}"))
    results = run(cfg, tmp_path / "out")
    decisions = results["scheduler"]["decisions"]
    formed = [d for d in decisions if d["decision"] == "FormFlotilla"]
    # longest first, one slot each while models wait: the two "slowest" ResNets, each with its own stream
    assert [f["members"] for f in formed[:2]] == ["{'resnet10_w16': 1}", "{'resnet10_w24': 1}"]
    resized = [d for d in decisions if d["decision"] == "Stop" and d["reason"] == "resized"]
    assert resized, [(d["decision"], d.get("members", d.get("model"))) for d in decisions]
    grown = {}
    for model in results["models"]:
        assert model["epochs"] == 4 and model["converged"]
        assert len(model["val_accuracy"]) == 4  # one validation per epoch, none lost or repeated
        if [len(stint["devices"]) for stint in model["flotillas"]][:2] == [1, 2]:
            grown[model["name"]] = model
    assert grown.keys() & {d["model"] for d in resized}
    for model in grown.values():  # resumed from the epoch it had finished, not from scratch
        restart = model["flotillas"][1]["start_epoch"]
        assert 0 < restart < 4 and model["train_loss"][restart] < model["train_loss"][0]
