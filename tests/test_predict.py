"""load_ensemble's refusals and its members left out: a folder no training run finished in, one written
before runs named their classes, a member without the checkpoint asked for, arguments that are not what a
prediction or an evaluation takes, files skipped. (Its predictions, evaluations and the command are checked
against real runs' validation in tests/test_run.py and tests/test_sweeps.py.)"""
import json
import shutil
from dataclasses import asdict

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import expand_ensemble
from pipeline.data.graph import GraphError, file_preprocessing
from pipeline.predict import PredictError, image_files, load_ensemble, main
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
    images = ensemble.preprocessing(files).images[kept.input]
    assert images.shape == (2, 64, 64, 3)
    x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
         * 255) / (torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the run's trainer.precision
        expected = torch.softmax(module.eval()(x).float(), dim=-1).numpy()
    assert ensemble.predict(files).probabilities == pytest.approx(expected, abs=1e-6)
    with pytest.raises(PredictError, match=rf"paths='{files[0]}': give a list of files"):
        ensemble.predict(files[0])
    with pytest.raises(PredictError, match=r"batch_size=0: give 1 or more files a batch"):
        ensemble.predict(files, batch_size=0)
    truncated = str(bad_dataset[1]["truncated"])
    with pytest.raises(BadFileError, match=rf"^{truncated}: corrupt or truncated JPEG: .*: give image files that "
                                           r"decode .*, or leave them out: on_error='skip'"):
        ensemble.predict([files[0], truncated])
    skipping = ensemble.predict([files[0], truncated, files[1]], batch_size=2, on_error="skip")  # rows stay aligned
    assert skipping.paths == files and list(skipping.skipped) == [truncated]
    assert skipping.skipped[truncated].startswith("corrupt or truncated JPEG")
    assert skipping.probabilities == pytest.approx(expected, abs=1e-6)
    with pytest.raises(PredictError, match=r"on_error='ignore': choose fail .* or skip"):
        ensemble.predict(files, on_error="ignore")
    absent = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(PredictError, match=rf"device='{absent}': this machine has \d+ CUDA device\(s\) torch can use"):
        load_ensemble(tmp_path, device=absent)
    with pytest.raises(PredictError, match=r"device='gpu': .*; give cpu, cuda or cuda:<index>"):
        load_ensemble(tmp_path, device="gpu")
    with pytest.raises(PredictError, match=r"device='meta': members compute on cpu or cuda"):
        load_ensemble(tmp_path, device="meta")

    # a folder of class folders to evaluate: named as the run's classes, holding files
    with pytest.raises(PredictError, match=rf"{files[0]} is not a folder: give a folder of class folders"):
        ensemble.evaluate(files[0])
    test = tmp_path / "test"
    (test / "a").mkdir(parents=True)
    with pytest.raises(PredictError, match=rf"{test} holds no class folders with files"):
        ensemble.evaluate(test)
    (test / "zebra").mkdir()
    with pytest.raises(PredictError, match=rf"{test}: class folder\(s\) zebra are none of the run's 3 classes "
                                           r"\(a, b, c\): give a folder of class folders named as the run's"):
        ensemble.evaluate(test)
    (test / "zebra").rmdir()
    (test / "a" / "broken.jpg").write_bytes(b"not a JPEG")
    with pytest.raises(PredictError, match=rf"{test}: none of its 1 files could be used \(the first, "
                                           rf"{test / 'a' / 'broken.jpg'}: not an image"):
        ensemble.evaluate(test, on_error="skip")
    split = tmp_path / "split"
    for folder in ("train/a", "val/a"):
        (split / folder).mkdir(parents=True)
    with pytest.raises(PredictError, match=rf"^{split} holds folders of folders \(train, val\): give the one of "
                                           rf"class folders to score, e.g. {split / 'val'}$"):
        ensemble.evaluate(split)
    # scored: the classes with files counted, what lies beside or inside the class folders named as not read
    for name, path in zip("ab", files):
        (test / name).mkdir(exist_ok=True)
        shutil.copy(path, test / name)
    (test / "c").mkdir()
    (test / "a" / "more").mkdir()
    (test / "notes.txt").write_text("")
    evaluation = ensemble.evaluate(test, on_error="skip")
    assert evaluation.files == {"a": 1, "b": 1} and list(evaluation.skipped) == [str(test / "a" / "broken.jpg")]
    assert evaluation.unread == [str(test / "notes.txt"), str(test / "a" / "more")]
    assert evaluation.accuracy == evaluation.member_accuracy[kept.name] == np.mean(expected.argmax(1) == [0, 1])


def test_the_command_refuses_what_it_cannot_use_in_one_line(tmp_path, capsys):
    """Arguments the command cannot use end it with code 2 and one line naming them (the run's own folder
    and files are used in tests/test_run.py); folders given are searched for files as a dataset's are."""
    def error(*argv):
        with pytest.raises(SystemExit) as ended:
            main([str(a) for a in argv])
        assert ended.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert error(tmp_path).endswith("give the image files or folders to predict, or --evaluate FOLDER_OR_CSV (one of the two)")
    assert error(tmp_path, "x.jpg", "--evaluate", tmp_path).endswith("(one of the two)")
    assert error(tmp_path, "x.jpg", "--top", 0).endswith("--top and --batch-size must be >= 1")
    assert error(tmp_path, "--evaluate", tmp_path, "--top", 2).endswith("--top is for predictions: --evaluate "
                                                                        "scores each file's most likely class")
    assert error(tmp_path, "x.jpg") == (f"python -m pipeline.predict: error: {tmp_path} holds no results.json (No such "
                                        "file or directory): give the folder of a run that trained (its results.json, "
                                        "checkpoints/)")
    (tmp_path / "photos" / "b" / ".hidden").mkdir(parents=True)
    for name in ("photos/2.jpg", "photos/1.jpg", "photos/.DS_Store", "photos/b/3.png", "photos/b/.hidden/4.jpg",
                 "photos/b/Thumbs.db", "one.jpg"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "5.jpg").write_bytes(b"")
    (tmp_path / "photos" / "c").symlink_to(tmp_path / "elsewhere")  # a link to a folder: followed
    (tmp_path / "photos" / "b" / "up").symlink_to(tmp_path / "photos")  # a link above itself: walked once
    assert image_files([str(tmp_path / "photos"), str(tmp_path / "one.jpg")]) == [
        str(tmp_path / name) for name in ("photos/1.jpg", "photos/2.jpg", "photos/b/3.png", "photos/c/5.jpg",
                                          "one.jpg")]
    with pytest.raises(PredictError, match=rf"^{tmp_path / 'nowhere'}: no such file or folder$"):
        image_files([str(tmp_path / "photos"), str(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PredictError, match=rf"^{tmp_path / 'empty'} hold\(s\) no files to predict$"):
        image_files([str(tmp_path / "empty")])


def test_a_file_one_branch_rejects_is_left_out_of_every_branchs_images(bad_dataset):
    """A stage of the user's on one branch rejects a file the other branch keeps: a prediction needs every
    member's row of a file, so the file is left out of both sinks' images, which stay aligned with `paths`."""
    def stages(*overrides):
        cfg = compose_config(["+ensemble=caltech256", f"dataset.root={bad_dataset[0]}", *overrides])
        return OmegaConf.to_container(cfg.pipeline.stages, resolve=True)

    files = sorted(str(path) for path in bad_dataset[0].glob("*/*.jpg"))[:4]
    plain = file_preprocessing(stages(), 0, str(bad_dataset[0]))(files)
    rejecting = file_preprocessing(stages("pipeline.stages.alt.inputs=[faulty]", "+pipeline.stages.faulty={_target_: "
                                          "tests.faulty_stage.Faulty, inputs: [crop_alt], fault: reject}"),
                                   0, str(bad_dataset[0]))(files)
    assert plain.paths == files and not plain.skipped
    assert rejecting.paths == files[1:] and rejecting.skipped == {files[0]: "rejected by the test's stage"}
    assert sorted(rejecting.images) == sorted(plain.images) == ["alt", "main"]
    for sink, images in rejecting.images.items():
        assert np.array_equal(images, plain.images[sink][1:]), sink
    doubling = file_preprocessing(stages("pipeline.stages.alt.inputs=[faulty]", "+pipeline.stages.faulty={_target_: "
                                         "tests.faulty_stage.Faulty, inputs: [crop_alt], fault: twice}"),
                                  0, str(bad_dataset[0]))
    with pytest.raises(GraphError, match=r"^pipeline.stages.alt: its batch of 4 files to predict holds other files "
                                         r"or another order than it was given: a stage on its branch"):
        doubling(files)  # rows that would go to the wrong files


def test_a_run_on_a_csv_file_evaluates_as_it_read_and_knows_the_images_it_listed(tmp_path, tiny_manifest,
                                                                               tiny_dataset, capsys):
    """A run's dataset.root a CSV file: its stages see paths relative to the file's folder, as the run's did;
    evaluated on that file, the ensemble scores its test rows; a folder or file holding images it listed for
    training or validation is noted as not held out, one holding only those of its test rows is not."""
    cfg = compose_config(["+ensemble=caltech256"])
    member = expand_ensemble(cfg.ensemble, 0)[0]
    classes = sorted(path.name for path in tiny_dataset.iterdir() if path.is_dir())
    checkpoint_path(tmp_path / "checkpoints", member.name, 1).parent.mkdir(parents=True)
    torch.save({"model": build_module(member, len(classes), 64).state_dict(), "member": asdict(member)},
               checkpoint_path(tmp_path / "checkpoints", member.name, 1))
    write(tmp_path, {"config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                     "dataset": {"class_names": classes, "root": str(tiny_manifest)},
                     "models": [{"name": member.name, "input": member.input, "image_size": 64,
                                 "best_checkpoint": {"epochs": 1}}]})
    ensemble = load_ensemble(tmp_path)
    assert ensemble.preprocessing.root == f"{tiny_manifest.parent}/"
    assert ensemble.evaluate(tiny_dataset).in_dataset
    held_out = ensemble.evaluate(tiny_manifest)  # its test rows
    assert held_out.files == dict.fromkeys(classes, 1) and held_out.unread_rows == {"train": 48, "val": 12}
    assert not held_out.in_dataset
    main([str(tmp_path), "--evaluate", str(tiny_manifest)])
    printed = capsys.readouterr()
    assert printed.err == "not read: 48 rows of split train, 12 rows of split val (a run on the file reads them)\n"
    assert printed.out.startswith(f"{tiny_manifest}: 4 files of 4 classes, each member's best checkpoint\n")

    test, rows = tmp_path / "test", [line.split(",") for line in tiny_manifest.read_text().splitlines()[1:]]
    for path, label, split in rows:
        if split == "test":
            (test / label).mkdir(parents=True)
            shutil.copy(tiny_manifest.parent / path, test / label)
    copied = ensemble.evaluate(test)
    assert sum(copied.files.values()) == 4 and not copied.in_dataset
    assert copied.accuracy == held_out.accuracy  # the same images, judged alike
    listed = tmp_path / "listed.csv"  # no split column: every row scored
    listed.write_text("path,label\n" + "".join(f"{tiny_manifest.parent / path},{label}\n" for path, label, split
                                               in rows if split != "train"))
    evaluation = ensemble.evaluate(listed)
    assert sum(evaluation.files.values()) == 16 and evaluation.unread_rows == {} and evaluation.in_dataset
    for text, error in [("path,label\n{a},zebra\n", r"label\(s\) zebra are none of the run's 4 classes \(.*\): "
                                                     r"give images of the run's classes"),
                        ("path,label,split\n{a},{c},val\n", r"its rows are all train or val ones, which a run on it "
                                                           r"reads; mark the held-out ones test"),
                        ("path,label\n{a}\n", r"line 2 gives no label")]:
        listed.write_text(text.format(a=tiny_manifest.parent / rows[0][0], c=classes[0]))
        with pytest.raises(PredictError, match=rf"^(--evaluate )?{listed}: {error}"):
            ensemble.evaluate(listed)
    tiny_manifest.rename(tmp_path / "moved.csv")  # gone since the run: nothing to tell
    try:
        assert not ensemble.evaluate(tiny_dataset).in_dataset
    finally:
        (tmp_path / "moved.csv").rename(tiny_manifest)
