"""The ensemble a run leaves, used after it: each member rebuilt from its checkpoint (its best, as the run's
`ensemble.kept` counts it, or its last) and the run's own validation preprocessing, so that any image files
are judged as the run judged its validation images.

    from pipeline.predict import load_ensemble
    ensemble = load_ensemble("outputs/2026-12-02/10-19-18")
    probabilities = ensemble.predict(["cat.jpg", "dog.png"])  # [2, classes]: the members' mean softmax
    ensemble.class_names[probabilities[0].argmax()]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.graph import FilePreprocessing, file_preprocessing
from pipeline.measure.recorder import as_counted
from pipeline.runtime.errors import UserError
from pipeline.training.group import Precision, autocast, autocast_dtype, normalise, training_memory_format
from pipeline.training.members import ModelSpec, build_module
from pipeline.training.trainer import checkpoint_path, saved_epochs

CHECKPOINTS = ("best", "last")


@dataclass
class Member:
    name: str
    sink: str  # the preprocessing branch it reads
    epochs: int  # trained before its checkpoint was written
    module: object  # torch.nn.Module, in eval mode on the ensemble's device


@dataclass
class TrainedEnsemble:
    class_names: list[str]  # in label order: a softmax's column k is class_names[k]
    members: dict[str, Member]
    left_out: dict[str, str]  # members given up before they had the checkpoint asked for: why each is not here
    preprocessing: FilePreprocessing
    device: object  # torch.device
    precision: Precision  # the run's trainer.precision: its validation's autocast

    def member_probabilities(self, paths: list[str | Path], batch_size: int = 64) -> dict[str, np.ndarray]:
        """Each member's softmax of each file, [len(paths), classes] float32, in the order of `paths`."""
        import torch

        if isinstance(paths, (str, Path)):
            raise PredictError(f"paths={str(paths)!r}: give a list of files, e.g. [{str(paths)!r}]")
        if batch_size < 1:
            raise PredictError(f"batch_size={batch_size}: give 1 or more files a batch")
        dtype, layout = autocast_dtype(self.precision), training_memory_format(self.device)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in self.members}
        with torch.inference_mode():
            for start in range(0, len(paths), batch_size):
                images = self.preprocessing(list(paths[start:start + batch_size]))
                inputs = {sink: normalise(x, self.device, layout) for sink, x in images.items()}
                for name, member in self.members.items():
                    with autocast(self.device, dtype):
                        logits = member.module(inputs[member.sink])
                    parts[name].append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        empty = np.zeros((0, len(self.class_names)), np.float32)
        return {name: np.concatenate(chunks) if chunks else empty for name, chunks in parts.items()}

    def predict(self, paths: list[str | Path], batch_size: int = 64) -> np.ndarray:
        """The ensemble's softmax of each file, as the run measured its accuracy: the members' mean, a
        member that diverged (NaN) counting as the uniform softmax."""
        probabilities = self.member_probabilities(paths, batch_size)
        return np.mean([as_counted(p) for p in probabilities.values()], axis=0)


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
        members[name] = Member(name, model["input"], epochs, module.to(device).eval())
    if not members:
        raise PredictError(f"{folder}: no member has a {checkpoint} checkpoint ({', '.join(left_out)} given up)")
    config = results["config"]
    preprocessing = file_preprocessing(config["pipeline"]["stages"], config["seed"], results["dataset"]["root"])
    return TrainedEnsemble(classes, members, left_out, preprocessing, torch.device(device),
                           Precision(config["trainer"]["precision"]))


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
