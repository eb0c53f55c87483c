"""The run's records: ensemble accuracy per epoch, whatever the ensemble's size."""
import numpy as np

from pipeline.measure.recorder import RunRecorder
from pipeline.training.reports import ValReport
from pipeline.training.group import GroupSpec, ModelSpec


def val_event(model, probs):
    probs = np.asarray(probs, np.float32)
    labels = np.array([0, 1])
    return ValReport(model, 0, float((probs.argmax(1) == labels).mean()), probs, labels)


def spec(name):
    return ModelSpec(name, "resnet", 10, 8, 12, 0.1, 0.9, 5e-4, 1, "main")


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


def test_ensemble_beats_its_members_when_their_mistakes_differ():
    """Three models each wrong on a different image: every one scores 2/3, the mean softmax 3/3."""
    names = ["a", "b", "c"]
    recorder = RunRecorder([spec(n) for n in names], dict.fromkeys(names, 1), dict.fromkeys(names, 32))
    labels = np.array([0, 1, 0])
    for index, name in enumerate(names):
        recorder.joined(alone(name), 0, ("cpu",), 0)
        probs = np.where(np.eye(2, dtype=bool)[labels], 0.8, 0.2).astype(np.float32)  # right, sure of it
        probs[index] = np.where(np.eye(2, dtype=bool)[labels[index]], 0.35, 0.65)  # wrong, less sure
        recorder.add_report(ValReport(name, 0, float((probs.argmax(1) == labels).mean()), probs, labels))
    results = recorder.as_dict(wall_s=1.0)
    assert [m["final_val_accuracy"] for m in results["models"]] == [2 / 3] * 3
    assert results["ensemble"]["val_accuracy"] == [1.0] and results["ensemble"]["final_val_accuracy"] == 1.0
