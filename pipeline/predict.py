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
from pipeline.training.group import normalise, training_memory_format
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
    preprocessing: FilePreprocessing
    device: object  # torch.device

    def member_probabilities(self, paths: list[str | Path], batch_size: int = 64) -> dict[str, np.ndarray]:
        """Each member's softmax of each file, [len(paths), classes] float32, in the order of `paths`."""
        import torch

        parts: dict[str, list[np.ndarray]] = {name: [] for name in self.members}
        with torch.inference_mode():
            for start in range(0, len(paths), batch_size):
                images = self.preprocessing(list(paths[start:start + batch_size]))
                inputs = {sink: normalise(x, self.device, training_memory_format(self.device))
                          for sink, x in images.items()}
                for name, member in self.members.items():
                    logits = member.module(inputs[member.sink])
                    parts[name].append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        empty = np.zeros((0, len(self.class_names)), np.float32)
        return {name: np.concatenate(chunks) if chunks else empty for name, chunks in parts.items()}

    def predict(self, paths: list[str | Path], batch_size: int = 64) -> np.ndarray:
        """The ensemble's softmax of each file, as the run measured its accuracy: the members' mean, a
        member that diverged (NaN) counting as the uniform softmax."""
        probabilities = self.member_probabilities(paths, batch_size)
        return np.mean([as_counted(p) for p in probabilities.values()], axis=0)


class NotARun(UserError):
    """The folder given is not one a run finished or stopped in, or lacks what its ensemble needs."""


def load_ensemble(run: str | Path, checkpoint: str = "best", device: str = "cpu") -> TrainedEnsemble:
    """The ensemble of the run in folder `run`: every member at its `checkpoint` ("best": the highest
    validation accuracy, what results.json's `ensemble.kept` measured; "last": its latest), on `device`.
    The run's stages come from its results.json: a stage of the user's must import as it did then."""
    import torch

    folder = Path(run)
    if checkpoint not in CHECKPOINTS:
        raise NotARun(f"checkpoint={checkpoint!r}: choose one of {', '.join(CHECKPOINTS)}")
    try:
        results = json.loads((folder / "results.json").read_text())
    except OSError as err:
        raise NotARun(f"{folder} holds no results.json ({err.strerror}): give the folder of a run that trained "
                      "(its results.json, checkpoints/)") from None
    if "class_names" not in results["dataset"]:
        raise NotARun(f"{folder / 'results.json'} names no classes (dataset.class_names): it was written before "
                      "runs recorded them; train it again to use its ensemble here")
    classes = results["dataset"]["class_names"]
    members = {}
    for model in results["models"]:
        name = model["name"]
        if checkpoint == "best":
            epochs = model["best_checkpoint"]["epochs"] if model["best_checkpoint"] else None
        else:
            epochs = max(saved_epochs(folder / "checkpoints", name), default=None)
        path = checkpoint_path(folder / "checkpoints", name, epochs) if epochs else folder / "checkpoints" / name
        if not path.is_file():
            raise NotARun(f"{folder}: member {name} has no {checkpoint} checkpoint ({path}): its run ended "
                          "before one was written (a member given up, say)")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        module = build_module(ModelSpec(**saved["member"]), len(classes), model["image_size"])
        module.load_state_dict(saved["model"])
        members[name] = Member(name, model["input"], epochs, module.to(device).eval())
    return TrainedEnsemble(classes, members, file_preprocessing(results["config"]["pipeline"]["stages"]),
                           torch.device(device))
