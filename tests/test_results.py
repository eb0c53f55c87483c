"""The run's records: ensemble accuracy per epoch, whatever the ensemble's size."""
import numpy as np

from pipeline.measure.recorder import RunRecorder
from pipeline.training.trainer import ModelSpec


def val_event(model, probs):
    return {"event": "val", "model": model, "rank": 0, "epoch": 0, "accuracy": 1.0,
            "probs": np.asarray(probs, np.float32), "labels": np.array([0, 1])}


def spec(name):
    return ModelSpec(name, "resnet", 10, 8, 12, 0.1, 0.9, 5e-4, 1, "main")


def test_ensemble_of_one_model_gets_its_accuracy():
    recorder = RunRecorder([spec("m")], {"m": 1}, {"m": 32})
    recorder.joined("m", 0, ("cpu",), 0)
    recorder.add_report(val_event("m", [[0.9, 0.1], [0.2, 0.8]]))
    assert recorder.ensemble_accuracy == {0: 1.0}


def test_ensemble_accuracy_waits_for_every_model_then_averages_softmax():
    recorder = RunRecorder([spec("a"), spec("b")], {"a": 1, "b": 1}, {"a": 32, "b": 32})
    for name in ("a", "b"):
        recorder.joined(name, 0, ("cpu",), 0)
    recorder.add_report(val_event("a", [[0.6, 0.4], [0.6, 0.4]]))
    assert recorder.ensemble_accuracy == {}
    recorder.add_report(val_event("b", [[0.9, 0.1], [0.0, 1.0]]))  # mean: [0.75, 0.25], [0.3, 0.7]
    assert recorder.ensemble_accuracy == {0: 1.0}
