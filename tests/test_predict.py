"""load_ensemble's refusals and its members left out: a folder no training run finished in, one written
before runs named their classes, a member without the checkpoint asked for, arguments that are not what a
prediction takes. (Its predictions are checked against real runs' validation in tests/test_run.py and
tests/test_sweeps.py.)"""
import json
from dataclasses import asdict

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import expand_ensemble
from pipeline.predict import PredictError, load_ensemble
from pipeline.training.members import build_module
from pipeline.training.trainer import checkpoint_path
from stages.base import BadFileError
from tests.conftest import compose_config


def write(folder, results):
    (folder / "results.json").write_text(json.dumps(results))


def test_a_folder_without_a_runs_ensemble_is_one_error_saying_what_is_missing(tmp_path):
    with pytest.raises(PredictError, match=rf"{tmp_path} holds no results.json \(No such file or directory\): give "
                                           r"the folder of a run that trained"):
        load_ensemble(tmp_path)
    with pytest.raises(PredictError, match=r"checkpoint='worst': choose one of best, last"):
        load_ensemble(tmp_path, "worst")
    (tmp_path / "results.json").write_text('{"models": [')
    with pytest.raises(PredictError, match=r"results.json is not JSON \(.*\): a run writes it whole"):
        load_ensemble(tmp_path)
    write(tmp_path, {"config": {"mode": "profile"}, "dataset": {"class_names": ["a"]}, "models": []})
    with pytest.raises(PredictError, match=r"is a mode=profile run's, which trains nothing"):
        load_ensemble(tmp_path)
    results = {"config": {"mode": "train"}, "dataset": {"classes": 2},
               "models": [{"name": "m", "best_checkpoint": None}]}
    write(tmp_path, results)
    with pytest.raises(PredictError, match=r"names no classes \(dataset.class_names\): it was written before"):
        load_ensemble(tmp_path)
    results["dataset"]["class_names"] = ["a", "b"]
    write(tmp_path, results)
    for checkpoint in ("best", "last"):
        with pytest.raises(PredictError, match=rf"{tmp_path}: member m has no {checkpoint} checkpoint$"):
            load_ensemble(tmp_path, checkpoint)
    results["interrupted"] = {"cause": "SIGINT", "resume": f"resume={tmp_path}"}
    write(tmp_path, results)
    with pytest.raises(PredictError, match=r"the run was stopped before one was written; go on with it "
                                           rf"\(resume={tmp_path}\)"):
        load_ensemble(tmp_path)


def test_a_member_given_up_without_a_checkpoint_is_left_out_and_the_others_predict(tmp_path, bad_dataset):
    """Two members of the default config, one with a checkpoint, one given up before its first: the ensemble
    is the first alone, its softmax of real files that of the saved module; wrong arguments are refused."""
    cfg = compose_config(["+ensemble=caltech256", "trainer.precision=bf16"])
    kept, lost = expand_ensemble(cfg.ensemble, 0)[:2]
    module = build_module(kept, 3, 64)
    checkpoint_path(tmp_path / "checkpoints", kept.name, 2).parent.mkdir(parents=True)
    torch.save({"model": module.state_dict(), "member": asdict(kept)},
               checkpoint_path(tmp_path / "checkpoints", kept.name, 2))
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    write(tmp_path, {"config": config, "dataset": {"class_names": ["a", "b", "c"], "root": str(bad_dataset[0])},
                     "given_up": [lost.name],
                     "models": [{"name": kept.name, "input": kept.input, "image_size": 64,
                                 "best_checkpoint": {"epochs": 2}},
                                {"name": lost.name, "input": lost.input, "image_size": 48, "best_checkpoint": None}]})
    ensemble = load_ensemble(tmp_path)
    assert list(ensemble.members) == [kept.name]
    assert ensemble.left_out == {lost.name: "given up before it had a best checkpoint"}
    files = [str(bad_dataset[1]["grayscale"]), str(bad_dataset[1]["cmyk"])]
    images = ensemble.preprocessing(files)[kept.input]
    assert images.shape == (2, 64, 64, 3)
    x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
         * 255) / (torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the run's trainer.precision
        expected = torch.softmax(module.eval()(x).float(), dim=-1).numpy()
    assert ensemble.predict(files) == pytest.approx(expected, abs=1e-6)
    with pytest.raises(PredictError, match=rf"paths='{files[0]}': give a list of files"):
        ensemble.predict(files[0])
    with pytest.raises(PredictError, match=r"batch_size=0: give 1 or more files a batch"):
        ensemble.predict(files, batch_size=0)
    with pytest.raises(BadFileError, match=rf"^{bad_dataset[1]['truncated']}: corrupt or truncated JPEG: .*: give "
                                           r"image files that decode"):
        ensemble.predict([files[0], str(bad_dataset[1]["truncated"])])
