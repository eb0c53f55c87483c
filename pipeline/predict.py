"""The ensemble a run leaves, used after it: each member rebuilt from its checkpoint (its best, as the run's
`ensemble.kept` counts it, or its last) and the run's own validation preprocessing, so that any image files
are judged as the run judged its validation images.

    from pipeline.predict import load_ensemble
    ensemble = load_ensemble("outputs/2026-12-02/10-19-18")
    predictions = ensemble.predict(["cat.jpg", "dog.png"])
    ensemble.class_names[predictions.probabilities[0].argmax()]  # the members' mean softmax
    ensemble.evaluate("data/test").accuracy  # a held-out folder of class folders, or a CSV file listing images

`python -m pipeline.predict RUN FILES_OR_FOLDERS... [--top k]` writes the predictions as CSV;
`python -m pipeline.predict RUN --evaluate FOLDER_OR_CSV` prints the accuracies (`--help`).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from pipeline.config import ExitCode
from pipeline.data.graph import FilePreprocessing, file_preprocessing
from pipeline.measure.recorder import as_counted
from pipeline.runtime.errors import UserError
from pipeline.training.group import Precision, autocast, autocast_dtype, normalise, training_memory_format
from pipeline.training.members import ModelSpec, build_module
from pipeline.training.trainer import checkpoint_path, saved_epochs
from stages.base import BadFileError, OnError, Split, StageError
from stages.read import class_files, hidden, is_manifest, manifest_rows

CHECKPOINTS = ("best", "last")


@dataclass
class Member:
    name: str
    sink: str  # the preprocessing branch it reads
    epochs: int  # trained before its checkpoint was written
    module: object  # torch.nn.Module, in eval mode on the ensemble's device


@dataclass
class Predictions:
    """What the ensemble made of some files (TrainedEnsemble.predict)."""

    paths: list[str]  # the files given, in their order, but those skipped (on_error="skip")
    members: dict[str, np.ndarray]  # each member's softmax of each file, [len(paths), classes] float32
    skipped: dict[str, str]  # each file that could not be used: why

    @cached_property
    def probabilities(self) -> np.ndarray:
        """The ensemble's softmax of each file, as the run measured its accuracy: the members' mean, a member
        that diverged (NaN) counting as the uniform softmax."""
        return np.mean([as_counted(p) for p in self.members.values()], axis=0)


@dataclass
class Evaluation:
    """How the ensemble and each member classify a folder of class folders or the images a CSV file lists
    (TrainedEnsemble.evaluate)."""

    source: str  # the folder or the CSV file
    files: dict[str, int]  # files scored, by class (those skipped not counted; a class without any not named)
    accuracy: float  # the ensemble's: the share of files whose most likely class is their label
    member_accuracy: dict[str, float]
    skipped: dict[str, str]  # each file that could not be used (on_error="skip"): why
    unread: list[str]  # files beside the class folders, folders inside them: not read
    unread_rows: dict[str, int]  # a CSV file's rows of the splits a run on it read (train, val), by split
    in_dataset: bool  # it holds files the run trained or validated on (_read_by_run): not held out


@dataclass
class TrainedEnsemble:
    class_names: list[str]  # in label order: a softmax's column k is class_names[k]
    members: dict[str, Member]
    left_out: dict[str, str]  # members given up before they had the checkpoint asked for: why each is not here
    checkpoint: str  # which of each member's checkpoints: "best" or "last"
    preprocessing: FilePreprocessing
    dataset: str  # the run's dataset.root: a folder, or a CSV file listing its images
    device: object  # torch.device
    precision: Precision  # the run's trainer.precision: its validation's autocast

    def predict(self, paths: list[str | Path], batch_size: int = 64, on_error: str = "fail") -> Predictions:
        """Each member's softmax of each file, and the ensemble's. A file that cannot be used is an error
        naming it (on_error="fail") or is left out, saying why (on_error="skip")."""
        import torch

        if isinstance(paths, (str, Path)):
            raise PredictError(f"paths={str(paths)!r}: give a list of files, e.g. [{str(paths)!r}]")
        if batch_size < 1:
            raise PredictError(f"batch_size={batch_size}: give 1 or more files a batch")
        if on_error not in list(OnError):
            raise PredictError(f"on_error={on_error!r}: choose fail (a file that cannot be used is an error) or "
                               "skip (it is left out, in Predictions.skipped)")
        dtype, layout = autocast_dtype(self.precision), training_memory_format(self.device)
        kept, skipped, parts = [], {}, {name: [] for name in self.members}
        with torch.inference_mode():
            for start in range(0, len(paths), batch_size):
                prepared = self.preprocessing([str(path) for path in paths[start:start + batch_size]])
                if prepared.skipped and on_error == OnError.fail:
                    raise BadFileError("; ".join(f"{path}: {why}" for path, why in prepared.skipped.items())
                                       + ": give image files that decode (JPEG, PNG, ... as the run's stages read "
                                       "them), or leave them out: on_error='skip' (the command's --on-error skip)")
                skipped.update(prepared.skipped)
                kept += prepared.paths
                inputs = {sink: normalise(x, self.device, layout) for sink, x in prepared.images.items()}
                for name, member in self.members.items():
                    with autocast(self.device, dtype):
                        logits = member.module(inputs[member.sink])
                    parts[name].append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        empty = np.zeros((0, len(self.class_names)), np.float32)
        return Predictions(kept, {name: np.concatenate(chunks) if chunks else empty
                                  for name, chunks in parts.items()}, skipped)

    def evaluate(self, source: str | Path, batch_size: int = 64, on_error: str = "fail") -> Evaluation:
        """The ensemble's and each member's accuracy on `source`, a held-out test set the run never read: a
        folder of class folders named as the run's classes (`<folder>/<class>/<image>`; all of them or some),
        or a CSV file listing labelled images as a dataset.root does (`path,label[,split]`; with a split
        column, its rows of other splits than train and val: those a run on it did not read). A file that
        cannot be used is an error naming it, or is left out (on_error="skip")."""
        root = Path(source)
        labels = {name: label for label, name in enumerate(self.class_names)}
        if is_manifest(root):
            (classes, unread_rows), unread = self._listed(root, labels), []
        elif root.is_dir():
            classes, unread = self._class_folders(root, labels)
            unread_rows = {}
        else:
            raise PredictError(f"{root} is not a folder: give a folder of class folders (<folder>/<class>/<image>) "
                               "or a CSV file listing labelled images (path,label)")
        truth = {path: labels[name] for name, paths in classes.items() for path in paths}
        predictions = self.predict(list(truth), batch_size, on_error)
        if not predictions.paths:
            path, why = next(iter(predictions.skipped.items()))
            raise PredictError(f"{root}: none of its {len(truth)} files could be used (the first, {path}: {why})")
        expected = np.array([truth[path] for path in predictions.paths])

        def accuracy(probabilities: np.ndarray) -> float:  # a member's as it made them, as the run counts it
            return float((probabilities.argmax(axis=1) == expected).mean())

        counts = np.bincount(expected, minlength=len(labels))
        return Evaluation(str(root), {name: int(counts[labels[name]]) for name in classes if counts[labels[name]]},
                          accuracy(predictions.probabilities),
                          {name: accuracy(p) for name, p in predictions.members.items()},
                          predictions.skipped, unread, unread_rows, _read_by_run(self.dataset, predictions.paths))

    def _class_folders(self, root: Path, labels: dict[str, int]) -> tuple[dict[str, list[str]], list[str]]:
        """`root`'s class folders' files, by class, all of them the run's classes; the files beside the
        class folders and the folders inside them, not read."""
        classes, unread = class_files(root)
        unknown = [name for name in classes if name not in labels]
        holding_folders = {os.path.relpath(path, root).split(os.sep)[0] for path in unread}
        if unknown and all(not classes[name] and name in holding_folders for name in unknown):  # a split dataset's
            raise PredictError(f"{root} holds folders of folders ({', '.join(unknown[:5])}): give the one of class "
                               f"folders to score, e.g. {root / unknown[-1]}")
        if unknown:
            raise PredictError(f"{root}: class folder(s) {self._none_of_the_runs(unknown)}: give a folder of class "
                               "folders named as the run's (<folder>/<class>/<image>)")
        if not any(classes.values()):
            raise PredictError(f"{root} holds no class folders with files: give a folder of class folders "
                               "(<folder>/<class>/<image>), named as the run's classes")
        with os.scandir(root) as entries:
            beside = sorted(entry.path for entry in entries if not entry.is_dir() and not hidden(entry.name))
        return classes, beside + unread

    def _listed(self, manifest: Path, labels: dict[str, int]) -> tuple[dict[str, list[str]], dict[str, int]]:
        """A CSV file's images to score, by class, all of them the run's classes: its rows, or with a split
        column those of other splits than train and val; the rows left, by split."""
        try:
            rows, has_split = manifest_rows(manifest, "--evaluate")
        except StageError as err:
            raise PredictError(str(err)) from None
        classes, left = {}, {}
        for path, label, split in rows:
            if has_split and split in (Split.TRAIN.value, Split.VAL.value):
                left[split] = left.get(split, 0) + 1
            else:
                classes.setdefault(label, []).append(path)
        if not classes:
            raise PredictError(f"{manifest}: its rows are all train or val ones, which a run on it reads; mark the "
                               "held-out ones test in its split column, or give a file that lists them")
        unknown = sorted(set(classes) - set(labels))
        if unknown:
            raise PredictError(f"{manifest}: label(s) {self._none_of_the_runs(unknown)}: give images of the run's "
                               "classes, labelled with their names")
        return classes, dict(sorted(left.items()))

    def _none_of_the_runs(self, unknown: list[str]) -> str:
        """`unknown` names (the first five) and that they are none of the run's classes (its first five)."""
        return (f"{', '.join(unknown[:5])}" + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
                + f" are none of the run's {len(self.class_names)} classes ({', '.join(self.class_names[:5])}"
                + (", ..." if len(self.class_names) > 5 else "") + ")")


def _read_by_run(dataset: str, paths: list[str]) -> bool:
    """Whether a run whose dataset.root was `dataset` trained or validated on any of the files `paths`: one
    lies in its folder, or its CSV file (where it is still there) lists one for either. Links to folders are
    followed, links to files are not (a folder of links into the dataset is a test set of its own)."""
    def where(path: str) -> str:
        return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))

    root = Path(dataset)
    if not is_manifest(root):
        folder = os.path.join(os.path.realpath(root), "")
        return any(where(path).startswith(folder) for path in paths)
    try:
        rows, _ = manifest_rows(root, "dataset.root")
    except StageError:  # moved or changed since: nothing to tell
        return False
    read = {where(path) for path, _, split in rows if split in ("", Split.TRAIN.value, Split.VAL.value)}
    return any(where(path) in read for path in paths)


class PredictError(UserError):
    """What load_ensemble or a prediction was given cannot be used: the message says why and what to give."""


def load_ensemble(run: str | Path, checkpoint: str = "best", device: str = "cpu") -> TrainedEnsemble:
    """The ensemble of the run in folder `run`: every member at its `checkpoint` ("best": the highest
    validation accuracy, what results.json's `ensemble.kept` measured; "last": its latest), on `device`;
    a member given up before it had one is left out (`left_out`). The run's stages come from its
    results.json: a stage of the user's must import as it did then."""
    import torch

    folder = Path(run)
    if checkpoint not in CHECKPOINTS:
        raise PredictError(f"checkpoint={checkpoint!r}: choose one of {', '.join(CHECKPOINTS)}")
    where = _device(device)
    results = _read_results(folder)
    classes = results["dataset"]["class_names"]
    members, left_out = {}, {}
    for model in results["models"]:
        name = model["name"]
        if checkpoint == "best":
            epochs = model["best_checkpoint"]["epochs"] if model["best_checkpoint"] else None
        else:
            epochs = max(saved_epochs(folder / "checkpoints", name), default=None)
        path = checkpoint_path(folder / "checkpoints", name, epochs) if epochs else None
        if path is None or not path.is_file():
            if name in results.get("given_up", []):
                left_out[name] = f"given up before it had a {checkpoint} checkpoint"
                continue
            stopped = results.get("interrupted")
            raise PredictError(f"{folder}: member {name} has no {checkpoint} checkpoint"
                               + (f" ({path} is missing)" if path else "")
                               + (f": the run was stopped before one was written; go on with it ({stopped['resume']})"
                                  if stopped else ""))
        saved = torch.load(path, map_location="cpu", weights_only=True)
        module = build_module(ModelSpec(**saved["member"]), len(classes), model["image_size"])
        module.load_state_dict(saved["model"])
        members[name] = Member(name, model["input"], epochs, module.to(where).eval())
    if not members:
        raise PredictError(f"{folder}: no member has a {checkpoint} checkpoint ({', '.join(left_out)} given up)")
    config = results["config"]
    preprocessing = file_preprocessing(config["pipeline"]["stages"], config["seed"], results["dataset"]["root"])
    return TrainedEnsemble(classes, members, left_out, checkpoint, preprocessing, results["dataset"]["root"], where,
                           Precision(config["trainer"]["precision"]))


def _device(name: str):
    """torch.device(name), one this machine has."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise PredictError(f"device={name!r}: {err}; give cpu, cuda or cuda:<index>") from None
    if device.type not in ("cpu", "cuda"):  # what runs train on
        raise PredictError(f"device={name!r}: members compute on cpu or cuda; give cpu, cuda or cuda:<index>")
    count = torch.cuda.device_count() if device.type == "cuda" else None
    if count is not None and (device.index or 0) >= count:
        raise PredictError(f"device={name!r}: this machine has {count} CUDA device(s) torch can use; give cpu"
                           + (f" or cuda:0 to cuda:{count - 1}" if count else ""))
    return device


def _read_results(folder: Path) -> dict:
    """The results.json of a training run in `folder`, with what an ensemble needs of it."""
    path = folder / "results.json"
    try:
        results = json.loads(path.read_text())
    except OSError as err:
        raise PredictError(f"{folder} holds no results.json ({err.strerror}): give the folder of a run that "
                           "trained (its results.json, checkpoints/)") from None
    except ValueError as err:
        raise PredictError(f"{path} is not JSON ({err}): a run writes it whole; give a run's folder") from None
    if results.get("config", {}).get("mode") == "profile":
        raise PredictError(f"{folder} is a mode=profile run's, which trains nothing: give a training run's folder")
    if "class_names" not in results.get("dataset", {}):
        raise PredictError(f"{path} names no classes (dataset.class_names): it was written before runs recorded "
                           "them, or is not a run's; train again to use the ensemble here")
    missing = [key for key in ("models", "config") if key not in results]
    if missing:
        raise PredictError(f"{path} lacks {', '.join(missing)}: it is not a training run's results")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.predict", description=(
        "Use the ensemble a run left, each member at its best (or last) checkpoint, files made as the run made "
        "its validation images: print each file's most likely classes as CSV, or, with --evaluate, score a "
        "folder of class folders or a CSV file of labelled images the run never read (a held-out test set). A reader that goes away (| head) "
        "ends it with code 141; the rows written before a file it cannot use stay."))
    parser.add_argument("run", help="the run's output folder (its results.json and checkpoints/)")
    parser.add_argument("paths", nargs="*", help="image files, or folders: every file inside, hidden ones aside")
    parser.add_argument("--evaluate", metavar="FOLDER_OR_CSV",
                        help="score FOLDER (<FOLDER>/<class>/<image>, class folders named as the run's) or the images "
                             "a CSV file lists (path,label; with a split column, its rows but train and val) "
                             "instead: the ensemble's and each member's accuracy")
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default="best",
                        help="each member's best checkpoint (the highest validation accuracy) or its last")
    parser.add_argument("--top", type=int, help="classes given per file, the most likely first (default 1)")
    parser.add_argument("--batch-size", type=int, default=64, help="files a batch")
    parser.add_argument("--device", default="cpu", help="where the members compute: cpu, cuda, cuda:1, ...")
    parser.add_argument("--on-error", choices=list(OnError), default=OnError.fail,
                        help="a file that cannot be used: fail stops, naming it; skip leaves it out, named on stderr")
    args = parser.parse_args(argv)
    if bool(args.paths) == bool(args.evaluate):
        parser.error("give the image files or folders to predict, or --evaluate FOLDER_OR_CSV (one of the two)")
    if args.evaluate and args.top is not None:
        parser.error("--top is for predictions: --evaluate scores each file's most likely class")
    if (args.top is not None and args.top < 1) or args.batch_size < 1:
        parser.error("--top and --batch-size must be >= 1")
    try:
        ensemble = load_ensemble(args.run, args.checkpoint, args.device)
        if args.evaluate:
            _print_evaluation(ensemble, ensemble.evaluate(args.evaluate, args.batch_size, args.on_error))
        else:
            _write_predictions(ensemble, image_files(args.paths), args.top or 1, args.batch_size, args.on_error)
    except UserError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except BrokenPipeError:  # the reader went away (| head): no traceback, the main command's code for it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush fails quietly
        sys.exit(ExitCode.sigpipe)


def image_files(paths: list[str]) -> list[str]:
    """`paths`, each folder among them replaced by the files inside it and its folders, links to folders
    followed (in name order, hidden ones and those the system writes there aside, as a dataset's are)."""
    files = []
    for given in paths:
        if os.path.isdir(given):
            seen = {os.path.realpath(given)}  # a link to a folder above it would be walked forever
            for folder, subfolders, names in os.walk(given, followlinks=True):
                subfolders[:] = [name for name in sorted(subfolders) if not hidden(name)
                                 and os.path.realpath(os.path.join(folder, name)) not in seen]
                seen.update(os.path.realpath(os.path.join(folder, name)) for name in subfolders)
                files += [os.path.join(folder, name) for name in sorted(names) if not hidden(name)]
        elif os.path.lexists(given):
            files.append(given)
        else:
            raise PredictError(f"{given}: no such file or folder")
    if not files:
        raise PredictError(f"{', '.join(paths)} hold(s) no files to predict")
    return files


def _write_predictions(ensemble: TrainedEnsemble, files: list[str], top: int, batch_size: int,
                       on_error: str) -> None:
    """CSV on stdout, a row a file: its path, then its `top` classes and their probabilities, a batch of rows
    at a time (a million files need no more memory than a batch); each file skipped named on stderr."""
    if top > len(ensemble.class_names):
        raise PredictError(f"--top {top}: the run has {len(ensemble.class_names)} classes; give at most that")
    out, written, skipped = csv.writer(sys.stdout), 0, {}
    for start in range(0, len(files), batch_size):
        predictions = ensemble.predict(files[start:start + batch_size], batch_size, on_error)
        if not start:  # after the first batch's errors, if any
            out.writerow(["path"] + [f"{column}_{rank}" for rank in range(1, top + 1)
                                     for column in ("class", "probability")])
        for path, why in predictions.skipped.items():
            print(f"skipped {path}: {why}", file=sys.stderr)
        skipped.update(predictions.skipped)
        probabilities = predictions.probabilities
        best = np.argsort(-probabilities, axis=1, kind="stable")[:, :top]
        for path, classes, row in zip(predictions.paths, best, probabilities):
            out.writerow([path] + [value for label in classes
                                   for value in (ensemble.class_names[label], f"{row[label]:.6f}")])
        written += len(predictions.paths)
        sys.stdout.flush()
    if not written:
        path, why = next(iter(skipped.items()))
        raise PredictError(f"none of the {len(files)} files could be used (the first, {path}: {why})")


def _print_evaluation(ensemble: TrainedEnsemble, evaluation: Evaluation) -> None:
    """The ensemble's accuracy, then each member's, on stdout; what was not scored on stderr."""
    for path, why in evaluation.skipped.items():
        print(f"skipped {path}: {why}", file=sys.stderr)
    for path in evaluation.unread:
        print(f"not read: {path} (only the files in class folders are)", file=sys.stderr)
    if evaluation.unread_rows:
        print("not read: " + ", ".join(f"{count} rows of split {split}" for split, count in
                                      evaluation.unread_rows.items()) + " (a run on the file reads them)",
              file=sys.stderr)
    if evaluation.in_dataset:
        print(f"note: {evaluation.source} holds files the run trained or validated on (its dataset, "
              f"{ensemble.dataset}): these accuracies are not a held-out set's", file=sys.stderr)
    width = max(len("ensemble"), *map(len, ensemble.members))
    print(f"{evaluation.source}: {sum(evaluation.files.values())} files of {len(evaluation.files)} classes, "
          f"each member's {ensemble.checkpoint} checkpoint")
    print(f"{'ensemble':<{width}}  {evaluation.accuracy:.4f}")
    for name, accuracy in evaluation.member_accuracy.items():
        print(f"{name:<{width}}  {accuracy:.4f}  (epoch {ensemble.members[name].epochs})")
    for name, why in ensemble.left_out.items():
        print(f"{name:<{width}}  left out: {why}")


if __name__ == "__main__":
    main()
