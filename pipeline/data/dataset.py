"""Finds the dataset a run trains on, generating the synthetic stand-in when
the configured root holds nothing (dataset.synthetic=auto)."""
from __future__ import annotations

import enum
import shutil
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import to_absolute_path

from pipeline.data.synthetic import generate_imagefolder, read_marker
from pipeline.runtime.errors import UserError


class Synthetic(enum.StrEnum):
    """dataset.synthetic: what a missing or empty dataset root does."""

    auto = "auto"  # a labelled stand-in is generated there
    never = "never"  # an error


class DatasetError(UserError):
    pass


@dataclass(frozen=True)
class DatasetInfo:
    root: Path
    synthetic: bool  # a generated stand-in, not real photos
    generated_now: bool


def prepare_dataset(root: str, synthetic: Synthetic, classes: int, images_per_class: int, difficulty: float,
                    seed: int) -> DatasetInfo:
    path = Path(to_absolute_path(root))
    try:
        empty = not path.exists() or (path.is_dir() and not any(path.iterdir()))
        marker = read_marker(path) if path.is_dir() else None
    except PermissionError as err:
        raise DatasetError(f"dataset.root {path} cannot be read by this user ({err.strerror}: {err.filename}); "
                           "give it read access (chmod -R a+rX), or set dataset.root to a copy it can read") from None
    if synthetic == Synthetic.never:
        if empty:
            raise DatasetError(f"dataset.root {path} is missing or empty; point dataset.root at an ImageFolder "
                               "tree (one sub-folder per class, e.g. 256_ObjectCategories) or set "
                               "dataset.synthetic=auto to generate a stand-in there")
        return DatasetInfo(path, marker is not None, False)
    if not empty and marker is None:
        return DatasetInfo(path, False, False)  # real data
    try:
        try:  # returns at once when this exact stand-in is already there
            generate_imagefolder(path, classes, images_per_class, seed, difficulty=difficulty)
        except FileExistsError:  # our own stand-in, made with other parameters
            shutil.rmtree(path)
            generate_imagefolder(path, classes, images_per_class, seed, difficulty=difficulty)
    except PermissionError as err:
        raise DatasetError(f"dataset.root {path} holds no dataset, and the synthetic stand-in cannot be written "
                           f"there ({err.strerror}: {err.filename}); set dataset.root to a folder this user can "
                           "write, or to a real dataset (dataset.synthetic=never makes a missing one an error)") from None
    return DatasetInfo(path, True, generated_now=read_marker(path) != marker)
