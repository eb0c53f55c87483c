"""Successive halving inside a run (scheduler.halving): the rule on hand-written metrics, the driver carrying
it out, and a real run whose culled members train no further epochs."""
import json
import math

import numpy as np
import pytest

from pipeline.orchestration.driver import Continue, Convergence, EpochDone, ReleaseModel, SaveCheckpoints
from pipeline.scheduler.halving import Halving
from pipeline.training.group import GroupSpec
from pipeline.training.reports import ValReport
from tests.test_driver import LABELS, driver_of, spec

ACCURACY = Halving(eta=2, min_epochs=1, metric="val_accuracy", higher_is_better=True)


def test_rungs_come_at_min_epochs_times_powers_of_eta():
    assert [e for e in range(1, 20) if Halving(3, 2, "val_loss", False).is_rung(e)] == [2, 6, 18]
    assert [e for e in range(1, 10) if ACCURACY.is_rung(e)] == [1, 2, 4, 8]


def test_a_rung_reached_by_all_at_once_keeps_the_best_half_by_the_metric_there():
    """Eight members in lockstep: at epoch 1 the four best go on; at epoch 2 (judged on epoch 2's values,
    not their best) two of those four. Fails if the weakest are kept, if an epoch that is not a rung culls,
    or if a rung is judged on the members' best epoch rather than the rung's."""
    first = {f"m{i}": [0.1 * i] for i in range(8)}
    assert sorted(ACCURACY.culled(list(first), first)) == ["m0", "m1", "m2", "m3"]
    second = {name: values + [{"m4": 0.9, "m5": 0.1, "m6": 0.2, "m7": 0.8}.get(name, 0.0)]
              for name, values in first.items() if name >= "m4"}
    assert sorted(ACCURACY.culled(list(second), {**first, **second})) == ["m5", "m6"]
    third = {name: values + [0.5] for name, values in second.items() if name in ("m4", "m7")}
    assert ACCURACY.culled(list(third), {**first, **second, **third}) == {}  # epoch 3 is no rung


def test_a_loss_ranks_lowest_first_and_a_late_member_is_judged_against_every_earlier_one():
    """ASHA's rule: b reaches the rung after a and c (another flotilla): it is ranked among all three.
    Fails if a loss ranks highest first, or a late arrival is judged only against its own round."""
    loss = Halving(eta=2, min_epochs=2, metric="val_loss", higher_is_better=False)
    metrics = {"a": [1.0, 0.5], "c": [1.0, 0.7]}
    assert loss.culled(["a", "c"], metrics) == {"c": "culled at epoch 2: val_loss 0.7 ranks 2 of 2, the best 1 go "
                                                      "on (scheduler.halving.eta=2)"}
    assert list(loss.culled(["b"], {**metrics, "b": [0.9, 0.6]})) == []  # 2nd of 3: the best 2 go on
    assert list(loss.culled(["d"], {**metrics, "b": [0.9, 0.6], "d": [0.9, 0.65]})) == ["d"]  # 3rd of 4


@pytest.mark.parametrize("order", [1, -1])
def test_a_diverged_member_ranks_last_wherever_it_stands(order):
    """A NaN loss (a member diverged) ranks below every number: b and c are culled, d (second best) goes on,
    whatever order the members come in. NaN compares false with all, and the sort kept it or not by place."""
    loss = Halving(eta=2, min_epochs=1, metric="val_loss", higher_is_better=False)
    metrics = dict(list({"a": [0.5], "b": [math.nan], "c": [0.7], "d": [0.6]}.items())[::order])
    assert sorted(loss.culled(list(metrics), metrics)) == ["b", "c"]


def val(model, epoch, accuracy):
    return ValReport(model, epoch, accuracy, np.array([[0.6, 0.4], [0.6, 0.4]], np.float32), LABELS)


def test_the_driver_saves_and_releases_the_culled_members_and_the_others_train_on(tmp_path, monkeypatch):
    group = GroupSpec("g", tuple(spec(name) for name in "abcd"))
    driver = driver_of([group], tmp_path, monkeypatch, epochs=5)
    driver.convergence = Convergence(5, None, 0, 0.005, ACCURACY)
    thread = driver.threads[0]
    driver._handle(EpochDone(thread, [val("a", 0, 0.4), val("b", 0, 0.9), val("c", 0, 0.2), val("d", 0, 0.7)], []))
    assert thread.taken() == [SaveCheckpoints("g", ("a",), 1), ReleaseModel("g", "a"),
                              SaveCheckpoints("g", ("c",), 1), ReleaseModel("g", "c"), Continue()]
    records = driver.run_ctx.recorder.models
    assert [name for name, r in records.items() if r.culled] == ["a", "c"]
    assert records["a"].converged.startswith("culled at epoch 1: val_accuracy 0.4 ranks 3 of 4")


def test_a_member_alone_in_its_group_leaves_culled_not_converged(tmp_path, monkeypatch):
    """Culled members that are whole groups leave through the scheduler, as converged ones do, and the run says
    why (a's leaving stops the flotilla under FleetG's 80% rule: c was stopped with it before its cull). Fails
    if the scheduler's Stop calls a culled member converged."""
    driver = driver_of([GroupSpec(name, (spec(name),)) for name in "abcd"], tmp_path, monkeypatch)
    driver.convergence = Convergence(5, None, 0, 0.005, ACCURACY)
    driver._handle(EpochDone(driver.threads[0], [val("a", 0, 0.4), val("b", 0, 0.9), val("c", 0, 0.2),
                                                 val("d", 0, 0.7)], []))
    said = driver.console.file.getvalue()
    assert "a leaves (culled)" in said and "converged" not in said


@pytest.mark.slow
def test_a_real_run_culls_at_each_rung_and_culled_members_train_no_further_epoch(tiny_manifest, tmp_path):
    """The default ensemble's 4 models, eta 2 from epoch 1, 3 epochs at most: 2 culled after epoch 1, 1 after
    epoch 2, 1 trains all 3; each culled member keeps its last checkpoint and its tracking stops there. (The
    dataset a CSV file with a split column: the run reads its train and val rows, and says what it left.)"""
    from pipeline.run import run
    from tests.conftest import compose_config

    cfg = compose_config(["+ensemble=caltech256", f"dataset.root={tiny_manifest}", "dataset.synthetic=never",
                          "pipeline.batch_size=16", "pipeline.image_size=32", "pipeline.alt_image_size=24",
                          "cluster.workers=2", "trainer.epochs=3", "scheduler.halving.eta=2"])
    results = json.loads(json.dumps(run(cfg, tmp_path), default=str))
    dataset = results["dataset"]
    assert (dataset["root"], dataset["train_images"], dataset["val_images"]) == (str(tiny_manifest), 4 * 12, 4 * 3)
    assert dataset["split"] == {"source": "column", "manifest": str(tiny_manifest)}
    assert dataset["unread_rows"] == {"test": 4}
    models = {m["name"]: m for m in results["models"]}
    assert sorted(m["epochs"] for m in models.values()) == [1, 1, 2, 3]
    assert [m["culled"] for m in models.values()] == [m["epochs"] < 3 for m in models.values()]
    first = sorted(models, key=lambda name: (-models[name]["val_accuracy"][0], name))
    assert {name for name in first[2:]} == {name for name, m in models.items() if m["epochs"] == 1}
    for name, m in models.items():
        assert (tmp_path / "checkpoints" / name / f"epoch{m['epochs']}.pt").is_file()
        if m["culled"]:
            assert m["converged"].startswith(f"culled at epoch {m['epochs']}: val_accuracy")
    rows = (tmp_path / "tracking" / "metrics.csv").read_text().splitlines()[1:]
    assert sorted(row.split(",")[0] for row in rows) == sorted(n for n, m in models.items() for _ in range(m["epochs"]))
