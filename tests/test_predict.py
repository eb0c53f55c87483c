"""load_ensemble's refusals: a folder no run finished in, one written before runs named their classes, a
member without the checkpoint asked for. (Its predictions are checked against real runs' validation in
tests/test_run.py and tests/test_sweeps.py.)"""
import json

import pytest

from pipeline.predict import NotARun, load_ensemble


def test_a_folder_without_a_runs_ensemble_is_one_error_saying_what_is_missing(tmp_path):
    with pytest.raises(NotARun, match=rf"{tmp_path} holds no results.json \(No such file or directory\): give the "
                                      r"folder of a run that trained"):
        load_ensemble(tmp_path)
    with pytest.raises(NotARun, match=r"checkpoint='worst': choose one of best, last"):
        load_ensemble(tmp_path, "worst")
    results = {"dataset": {"classes": 2}, "models": [{"name": "m", "best_checkpoint": None}]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    with pytest.raises(NotARun, match=r"names no classes \(dataset.class_names\): it was written before"):
        load_ensemble(tmp_path)
    results["dataset"]["class_names"] = ["a", "b"]
    (tmp_path / "results.json").write_text(json.dumps(results))
    for checkpoint in ("best", "last"):
        with pytest.raises(NotARun, match=rf"member m has no {checkpoint} checkpoint \({tmp_path}/checkpoints/m\): "
                                          "its run ended before one was written"):
            load_ensemble(tmp_path, checkpoint)
