"""The run's records: ensemble accuracy per epoch, whatever the ensemble's size."""
import math

import numpy as np
import pytest

from pipeline.measure.recorder import RunRecorder
from pipeline.training.reports import ValReport
from pipeline.training.group import GroupSpec
from tests.conftest import member


def val_event(model, probs, epoch=0):
    probs = np.asarray(probs, np.float32)
    labels = np.array([0, 1])
    return ValReport(model, epoch, float((probs.argmax(1) == labels).mean()), probs, labels)


def spec(name):
    return member(name)


def alone(name):
    return GroupSpec(name, (spec(name),))


def test_ensemble_of_one_model_gets_its_accuracy():
    recorder = RunRecorder([spec("m")], {"m": 1}, {"m": 32})
    recorder.joined(alone("m"), 0, ("cpu",), 0)
    recorder.add_report(val_event("m", [[0.9, 0.1], [0.2, 0.8]]))
    assert recorder.ensemble_accuracy == {0: 1.0}


def test_ensemble_accuracy_waits_for_every_model_then_averages_softmax():
    recorder = RunRecorder([spec("a"), spec("b")], {"a": 1, "b": 1}, {"a": 32, "b": 32})
    for name in ("a", "b"):
        recorder.joined(alone(name), 0, ("cpu",), 0)
    recorder.add_report(val_event("a", [[0.6, 0.4], [0.6, 0.4]]))
    assert recorder.ensemble_accuracy == {}
    recorder.add_report(val_event("b", [[0.9, 0.1], [0.0, 1.0]]))  # mean: [0.75, 0.25], [0.3, 0.7]
    assert recorder.ensemble_accuracy == {0: 1.0}


def test_a_diverged_member_leaves_the_ensemble_to_the_others():
    """c diverged (NaN logits, so NaN softmax): a and b's mean gets both images right, and so does the
    ensemble of all three, each epoch's and the one of best checkpoints; c's own loss stays NaN. A NaN in the
    sum made every image's argmax class 0 (accuracy 0.5 here: the share of class 0)."""
    recorder = RunRecorder([spec("a"), spec("b"), spec("c")], dict.fromkeys("abc", 1), dict.fromkeys("abc", 32))
    for name, probs in (("a", [[0.6, 0.4], [0.6, 0.4]]), ("b", [[0.9, 0.1], [0.0, 1.0]]),
                        ("c", [[math.nan, math.nan], [math.nan, math.nan]])):
        recorder.joined(alone(name), 0, ("cpu",), 0)
        recorder.add_report(val_event(name, probs))
        recorder.checkpointed(name, 1)
    ensemble = recorder.as_dict(wall_s=1.0)["ensemble"]
    assert ensemble["val_accuracy"] == [1.0] and ensemble["final_val_accuracy"] == 1.0
    assert ensemble["kept"]["val_accuracy"] == 1.0
    assert math.isnan(recorder.as_dict(wall_s=1.0)["models"][2]["val_loss"][0])


def test_ensemble_beats_its_best_member_when_their_mistakes_differ():
    """Five images, each one wrong in one model only, sure when right and less sure when wrong: the mean
    softmax gets all five right, the best member (b) 4 of 5. The ensemble taken as one member's softmax or
    from the members' accuracies, or the best member's accuracy as the first's, the last's or their mean,
    fails."""
    labels = np.array([0, 1, 0, 1, 0])
    wrong = {"a": [0, 1], "b": [2], "c": [3, 4]}
    reported = {"a": 3 / 5, "b": 4 / 5, "c": 3 / 5}  # what their trainers measured
    recorder = RunRecorder([spec(n) for n in wrong], dict.fromkeys(wrong, 1), dict.fromkeys(wrong, 32))
    for name, images in wrong.items():
        recorder.joined(alone(name), 0, ("cpu",), 0)
        probs = np.where(np.eye(2, dtype=bool)[labels], 0.8, 0.2).astype(np.float32)  # right, sure of it
        probs[images] = np.where(np.eye(2, dtype=bool)[labels[images]], 0.35, 0.65)  # wrong, less sure
        recorder.add_report(ValReport(name, 0, reported[name], probs, labels))
    ensemble = recorder.as_dict(wall_s=1.0)["ensemble"]
    assert ensemble["val_accuracy"] == [1.0] and ensemble["final_val_accuracy"] == 1.0
    assert ensemble["best_model_val_accuracy"] == 4 / 5


def test_an_epoch_done_again_after_a_resume_counts_once_and_the_record_survives_a_restart(tmp_path):
    """a finishes epochs 1 and 2, fails, resumes from its checkpoint after 1 epoch and does epoch 2 again:
    the ensemble at epoch 2 (b gets there last) averages a's second softmax with b's, not both of a's.
    Saved and loaded (a resumed run), the records go on the same way."""
    recorder = RunRecorder([spec("a"), spec("b")], {"a": 1, "b": 1}, {"a": 32, "b": 32})
    for name in ("a", "b"):
        recorder.joined(alone(name), 0, ("cpu",), 0)
    right, wrong = [[0.9, 0.1], [0.1, 0.9]], [[0.1, 0.9], [0.9, 0.1]]
    recorder.add_report(val_event("a", right, epoch=0))
    recorder.add_report(val_event("a", wrong, epoch=1))
    recorder.checkpointed("a", 1)
    recorder.joined(alone("a"), 1, ("cpu",), 1)  # resumed after 1 epoch: its epoch 2 is forgotten
    assert recorder.accuracies("a") == [1.0]
    recorder.add_report(val_event("a", right, epoch=1))
    recorder.save_state(tmp_path)
    restarted = RunRecorder([spec("a"), spec("b")], {"a": 1, "b": 1}, {"a": 32, "b": 32})
    restarted.load_state(tmp_path)
    for r in (recorder, restarted):
        weak_and_wrong = [[0.4, 0.6], [0.6, 0.4]]
        r.add_report(val_event("b", weak_and_wrong, epoch=0))
        r.add_report(val_event("b", weak_and_wrong, epoch=1))
        # a's right softmax outweighs b's; with a's first epoch 2 counted too, a's two cancel and b's decides
        assert r.ensemble_accuracy == {0: 1.0, 1: 1.0}
        assert r.accuracies("a") == [1.0, 1.0]
        assert r.as_dict(1.0)["ensemble"]["final_val_accuracy"] == 1.0


def test_validation_loss_is_the_cross_entropy_of_each_softmax_and_of_their_mean():
    """Fails if the ensemble's loss is the mean of the members' losses (0.383 here), if a softmax that
    gives the true class 0 makes it infinite, or if the loss reads another class than the label's."""
    recorder = RunRecorder([spec("a"), spec("b")], {"a": 1, "b": 1}, {"a": 32, "b": 32})
    for name in ("a", "b"):
        recorder.joined(alone(name), 0, ("cpu",), 0)
    recorder.add_report(val_event("a", [[0.6, 0.4], [0.6, 0.4]]))
    recorder.add_report(val_event("b", [[0.9, 0.1], [1.0, 0.0]]))  # mean: [0.75, 0.25], [0.8, 0.2]
    results = recorder.as_dict(wall_s=1.0)
    a, b = results["models"]
    assert np.isclose(a["val_loss"], [-(math.log(0.6) + math.log(0.4)) / 2]).all()
    assert np.isclose(b["val_loss"], [-(math.log(0.9) + math.log(1e-12)) / 2]).all()
    ensemble = -(math.log(0.75) + math.log(0.2)) / 2
    assert np.isclose(results["ensemble"]["val_loss"], [ensemble]).all()
    assert np.isclose(results["ensemble"]["final_val_loss"], ensemble)


def test_a_part_of_the_ensemble_is_judged_on_its_own_members(tmp_path):
    """Parts (a shared sweep run's jobs) overlap, as jobs share the members a sweep does not change.
    Part x = {a, b} gets its accuracy once both reported, whatever c says; part y = {b, c} from b and c
    alone; an epoch a member does again replaces its own softmax. A stop and resume between the reports
    (the state saved, a new recorder loads it) changes nothing. A part's accuracy taken from the whole
    ensemble (1.0 here, x's 0.5), from a's first softmax or from both of a's (0.0), or a part's sums or
    figures lost with the resume, fails."""
    names = ("a", "b", "c")
    recorded = lambda: RunRecorder([spec(n) for n in names], dict.fromkeys(names, 1), dict.fromkeys(names, 32),
                                   {"x": ["a", "b"], "y": ["b", "c"]})
    recorder = recorded()
    for name in names:
        recorder.joined(alone(name), 0, ("cpu",), 0)
    recorder.add_report(val_event("a", [[0.0, 1.0], [1.0, 0.0]]))  # first both wrong
    recorder.add_report(val_event("a", [[0.6, 0.4], [0.4, 0.6]]))  # done again: both right, what stands
    recorder.add_report(val_event("c", [[0.9, 0.1], [0.0, 1.0]]))
    assert recorder.part_accuracy == {"x": {}, "y": {}}
    recorder.save_state(tmp_path / "stopped")
    recorder = recorded()
    recorder.load_state(tmp_path / "stopped")
    recorder.add_report(val_event("b", [[0.7, 0.3], [0.7, 0.3]]))  # x: [1.3, 0.7], [1.1, 0.9]: 1 of 2
    # (with a's first softmax instead: [0.7, 1.3], [1.7, 0.3]; with both of a's: [1.3, 1.7], [2.1, 0.9])
    assert recorder.part_accuracy == {"x": {0: 0.5}, "y": {0: 1.0}}  # y: [1.6, 0.4], [0.7, 1.3]
    assert recorder.ensemble_accuracy == {0: 1.0}  # [2.2, 0.8], [1.1, 1.9]
    recorder.save_state(tmp_path / "done")
    recorder = recorded()
    recorder.load_state(tmp_path / "done")
    parts = recorder.as_dict(1.0)["parts"]
    assert parts["x"]["val_accuracy"] == [0.5] and parts["x"]["best_model_val_accuracy"] == 1.0
    assert parts["x"]["val_loss"] == pytest.approx([-(math.log(1.3 / 2) + math.log(0.9 / 2)) / 2], rel=1e-6)
    assert parts["y"]["best_model_val_accuracy"] == 1.0


def test_a_workers_busy_share_is_over_its_own_threads():
    """A remote cluster's workers have threads of their own (`dask worker --nthreads 4`, or one per core):
    2 s of batch tasks in 1 s of training on a worker of 4 threads is 50% busy. Over the local cluster's
    cluster.threads_per_worker (1) it was 200%, and the verdict said the workers limit the input."""
    from pipeline.data.graph import BatchOutput

    recorder = RunRecorder([spec("m")], {"m": 1}, {"m": 32})
    for started in (0.0, 0.5):
        recorder.add_batch(BatchOutput({}, {}, worker="worker w", worker_threads=4, started=started,
                                       ended=started + 1.0), train=True)
    assert recorder.worker_busy_pct(1.0) == {"worker w": 50.0}
