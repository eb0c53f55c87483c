"""Finds the dataset a run trains on, generating the synthetic stand-in when
the configured root holds nothing (dataset.synthetic=auto); a root that names
a CSV file listing the images is read as it is."""
from __future__ import annotations

import enum
import fcntl
import functools
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from hydra.utils import to_absolute_path

from pipeline.data.synthetic import generate_imagefolder, read_marker
from pipeline.runtime.errors import UserError
from stages.read import is_manifest


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
    # a stand-in's in-use lock, held (shared) until `release`: no other run makes it again meanwhile
    in_use: IO | None = field(default=None, compare=False, repr=False)

    def release(self) -> None:
        """The run is done with the dataset: another run may make its stand-in again."""
        if self.in_use is not None:
            self.in_use.close()


STAND_IN_SEED = 0  # the stand-in is one dataset per dataset.synthetic_* values, whatever the run's seed


def prepare_dataset(root: str, synthetic: Synthetic, classes: int, images_per_class: int,
                    difficulty: float) -> DatasetInfo:
    path = Path(to_absolute_path(root))
    if is_manifest(path):  # a file the user wrote: never a stand-in's place
        if not path.is_file():
            raise DatasetError(f"dataset.root {path}: no such file; set dataset.root to the CSV file listing the "
                               "images (path,label[,split]), or to a folder of class folders")
        return DatasetInfo(path, False, False)
    try:
        empty = not path.exists() or (path.is_dir() and not any(path.iterdir()))
        marker = read_marker(path) if path.is_dir() else None
    except PermissionError as err:
        raise DatasetError(f"dataset.root {path} cannot be read by this user ({err.strerror}: {err.filename}); "
                           "give it read access (chmod -R a+rX), or set dataset.root to a copy it can read") from None
    if synthetic == Synthetic.never:
        if empty:
            raise DatasetError(f"dataset.root {path} is missing or empty; point dataset.root at an ImageFolder "
                               "tree (one sub-folder per class, e.g. 256_ObjectCategories) or a CSV file listing "
                               "the images, or set "
                               "dataset.synthetic=auto to generate a stand-in there")
    if not empty and marker is None:
        return DatasetInfo(path, False, False)  # real data
    if synthetic == Synthetic.never:  # a stand-in made before: held as with auto, but never made anew
        return DatasetInfo(path, True, False, in_use=_stand_in_held(path, None))
    make = functools.partial(generate_imagefolder, path, classes, images_per_class, STAND_IN_SEED,
                             difficulty=difficulty)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # where the locks are
        in_use = _stand_in_held(path, make)
    except PermissionError as err:
        raise DatasetError(f"dataset.root {path} holds no dataset, and the synthetic stand-in cannot be written "
                           f"there ({err.strerror}: {err.filename}); set dataset.root to a folder this user can "
                           "write, or to a real dataset (dataset.synthetic=never makes a missing one an error)"
                           ) from None
    return DatasetInfo(path, True, generated_now=read_marker(path) != marker, in_use=in_use)


def _stand_in_held(path: Path, make) -> IO | None:
    """The stand-in at `path`, made by `make()` (at once if it is there; None: never made, the one there is
    held), and its in-use lock, held shared for the run. One run at a time checks and makes it (the runs of a
    parallel sweep start together); one that would make it anew (other parameters) while another run holds
    it stops, naming the fix. Only holders of the making lock take the in-use lock exclusively."""
    in_use = _lock_file(path, "in-use")
    try:
        with _held(_lock_file(path, "making"), fcntl.LOCK_EX):
            try:
                if make is not None:
                    make()
            except FileExistsError:  # our own stand-in, made with other parameters
                if not _locked(in_use, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    raise DatasetError(
                        f"dataset.root {path} holds the synthetic stand-in made with other parameters, and another "
                        "run trains on it: it is made anew only when none does. Give each run a root of its own "
                        "(a sweep over dataset.synthetic_*: e.g. 'dataset.root=data/stand_in_"
                        "${dataset.synthetic_difficulty}'), or start this one once that run has ended") from None
                shutil.rmtree(path)
                make()
            _locked(in_use, fcntl.LOCK_SH)
    except BaseException:
        if in_use is not None:
            in_use.close()
        raise
    return in_use


def _lock_file(root: Path, kind: str) -> IO | None:
    """The stand-in's lock file of `kind` beside it (made if this user may), open; None where there is
    none and it cannot be made (a stand-in this user cannot make anew either)."""
    path = root.parent / f".{root.name}.{kind}.lock"
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # flock takes either kind of descriptor
        try:
            return os.fdopen(os.open(path, flags, 0o666), "rb", buffering=0)
        except (PermissionError, FileNotFoundError):
            pass
    return None


def _locked(lock: IO | None, how: int) -> bool:
    """Takes `lock` as `how` (fcntl.flock's operations): False if LOCK_NB found it held. No lock file:
    True (nothing to coordinate with)."""
    if lock is None:
        return True
    try:
        fcntl.flock(lock, how)
    except BlockingIOError:
        return False
    return True


@contextmanager
def _held(lock: IO | None, how: int) -> Iterator[None]:
    """`lock` taken as `how` inside the with block, then closed."""
    try:
        _locked(lock, how)
        yield
    finally:
        if lock is not None:
            lock.close()
