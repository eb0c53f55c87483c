"""Source stage: an ImageFolder tree (Caltech256 layout), or a CSV file listing images, read batch by batch."""
from __future__ import annotations

import csv
import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Collection

import numpy as np

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Split, Stage, StageError

SPLIT_FILE = "split.json"  # a dataset's own split, {"val_per_class": <fraction or count>}, at its root
# A dataset split in folders, <root>/train/<class>/... and <root>/val/<class>/...: the names those folders
# go by (as timm's datasets find them); any other folder beside them (test/) is not read.
TRAIN_FOLDERS = ("train", "training")
VAL_FOLDERS = ("val", "valid", "validation")
# What Windows writes into folders of pictures (thumbnail caches, folder settings): never an image, not read as
# the hidden files of other systems are not (it took a validation place, then was skipped every epoch)
SYSTEM_FILES = frozenset({"thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini"})
DEFAULT_VAL_PER_CLASS = 0.1  # the split of a dataset that declares none
# A dataset listed in a CSV file (dataset.root=<file>.csv): the columns its header names; others are not read
MANIFEST_SUFFIX = ".csv"
MANIFEST_COLUMNS = ("path", "label")  # the image (relative to the file's folder, or absolute), its class's name
SPLIT_COLUMN = "split"  # optional: train or val (as the folders of a split dataset are named); other rows not read


@dataclass(frozen=True)
class SplitChoice:
    """Which images validate, and where that was chosen: a sentence in the run's first line and in errors
    (str), an object in results.json's dataset.split (`summary`)."""

    source: str  # "dataset.val_per_class", "default", the dataset's split.json (its path), "folders" or "column"
    val_per_class: float | None = None  # a fraction if < 1, else a count; None when split in folders or a column
    folders: tuple[str, str] | None = None  # (train, val)'s names, when split in folders
    manifest: str | None = None  # the CSV file whose split column chose

    def __str__(self) -> str:
        if self.folders:
            return f"the dataset's own {self.folders[0]}/ and {self.folders[1]}/ folders"
        if self.manifest:
            return f"the {SPLIT_COLUMN} column of {self.manifest}"
        value = f"val_per_class={self.val_per_class:g}"
        if self.source == "default":
            return f"the default {value}"
        if self.source == "dataset.val_per_class":
            return f"{value} (dataset.val_per_class)"
        return f"{value} declared in {self.source}"

    def summary(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass
class ImageFolder(Stage):
    """Class folders of images (`001.ak47/001_0001.jpg`) with a fixed per-class
    train/val split, a dataset split in folders (`train/n01440764/...`,
    `val/n01440764/...`), or a CSV file listing its images (`path,label[,split]`:
    split per class as class folders are, or by its split column as folders);
    training batches reshuffled every epoch by seed.

    A split that leaves a class fewer than 2 training images, or fewer training
    than validation images, is an error naming the class and the fix."""

    root: str  # dataset folder holding one sub-folder per class, or train/ and val/ folders of them; or a CSV file
    batch_size: int  # images per batch (the last batch of a split may be smaller)
    val_per_class: float | None = None  # validation images per class: a fraction if < 1, else a count;
    # None: the dataset's own split, its train/ and val/ folders or <root>/split.json (the synthetic stand-in
    # has one), else 0.1
    split_seed: int = 0  # fixes which files are validation, independent of the training seed

    role: ClassVar[Role] = Role.SOURCE
    accepts: ClassVar[DataKind | None] = None
    same_every_epoch: ClassVar[bool] = True  # each file's bytes (the order changes, not the items)

    class_names: list[str] = field(init=False, default_factory=list)
    files: dict[Split, list[tuple[str, int]]] = field(init=False, default_factory=dict)
    split: SplitChoice = field(init=False, default=SplitChoice("default", DEFAULT_VAL_PER_CLASS))
    # Folders inside class folders (relative to root; Caltech-256's 056.dog/greg): not read, said at the start
    unread: list[str] = field(init=False, default_factory=list)
    # A CSV file's rows of other splits (test), by split: not read, said at the start
    unread_rows: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise StageError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.val_per_class is not None and self.val_per_class < 0:
            raise StageError(f"val_per_class must be >= 0 (a fraction < 1 or a count), got {self.val_per_class}; "
                             "set dataset.val_per_class")
        self._scan()

    @property
    def prefix(self) -> str:
        """How every file path of the dataset begins: what a path inside it is relative to."""
        return dataset_folder(self.root)

    def _scan(self) -> None:
        root = Path(self.root)
        if is_manifest(root):
            self._scan_manifest(root)
            return
        if not root.is_dir():
            raise StageError(f"dataset root {root} does not exist; set dataset.root to an ImageFolder tree "
                             "(one sub-folder per class) or a CSV file listing the images, or "
                             "dataset.synthetic=auto to generate a stand-in")
        try:
            folders = _split_folders(root)
            if folders:
                self._scan_split_folders(root, *folders)
            else:
                self._scan_classes(root)
        except PermissionError as err:  # a folder this user cannot list: a class would be lost unsaid
            raise StageError(f"dataset root {root}: this user was refused {err.filename} ({err.strerror}); give "
                             "the dataset read access (chmod -R a+rX) or set dataset.root to a copy it can read"
                             ) from None
        if not self.files[Split.TRAIN]:
            where = f" in {folders[0]}" if folders else ""
            raise StageError(f"dataset root {root} holds no class folders with files{where}; expected "
                             "<root>/<class>/<image> (e.g. 001.ak47/001_0001.jpg), or <root>/train/<class>/<image> "
                             "and <root>/val/<class>/<image>; set dataset.root")

    def _scan_classes(self, root: Path) -> None:
        """One folder of classes, split per class by val_per_class."""
        self.split = self._choose_split(root)
        classes = self._class_files(root)
        _check_no_empty_class(root, classes)
        self._split_per_class(classes)

    def _split_per_class(self, classes: dict[str, list[str]]) -> None:
        """`classes`' files (by class, in label order; each class's paths sorted) split by self.split."""
        self.class_names = list(classes)
        counts = [self._val_count(len(paths)) for paths in classes.values()]
        self._check_split(list(classes.values()), counts)
        self.files = {Split.TRAIN: [], Split.VAL: []}
        for label, (paths, n_val) in enumerate(zip(classes.values(), counts)):
            order = np.random.default_rng([self.split_seed, label]).permutation(len(paths))
            for rank, i in enumerate(order):
                self.files[Split.VAL if rank < n_val else Split.TRAIN].append((paths[i], label))

    def _scan_split_folders(self, root: Path, train: Path, val: Path) -> None:
        """A dataset split in folders (ImageNet's and Imagenette's layout): its classes are train's, its
        validation images val's. A second split asked of it (val_per_class, split.json) is an error: one
        of them would be dropped."""
        layout = f"dataset root {root} is split in folders ({train.name}/ and {val.name}/)"
        if self.val_per_class is not None:
            raise StageError(f"{layout}, so its validation images are those in {val}; remove "
                             f"dataset.val_per_class={self.val_per_class:g}, or point dataset.root at {train} to "
                             "split that folder by it instead")
        if (root / SPLIT_FILE).exists():
            raise StageError(f"{layout} and also declares a split in {root / SPLIT_FILE}; remove that file")
        trained, validated = self._class_files(train), self._class_files(val)
        _check_no_empty_class(train, trained)
        unknown = sorted(set(validated) - set(trained))
        if unknown:
            raise StageError(f"{layout}, but class folder(s) {', '.join(unknown)} of {val} have none in {train} "
                             "to train on; add them there or remove them from the validation folder")
        self.split = SplitChoice("folders", folders=(train.name, val.name))
        self.class_names = list(trained)
        labels = {name: label for label, name in enumerate(self.class_names)}
        self.files = {Split.TRAIN: [(path, labels[name]) for name, paths in trained.items() for path in paths],
                      Split.VAL: [(path, labels[name]) for name, paths in validated.items() for path in paths]}

    def _scan_manifest(self, manifest: Path) -> None:
        """A CSV file listing the images (MANIFEST_COLUMNS, and SPLIT_COLUMN if the file splits them itself):
        without a split column, split per class as a folder of classes is (by val_per_class, else 0.1); with
        one, as a dataset split in folders (its classes are the training rows')."""
        rows, has_split = manifest_rows(manifest, "dataset.root")
        by_split: dict[str, dict[str, list[str]]] = {}
        for path, label, split in rows:
            by_split.setdefault(split, {}).setdefault(label, []).append(path)
        if not has_split:
            self.split = self._choose_split(None)
            self._split_per_class(_in_label_order(by_split[""]))
            return
        if self.val_per_class is not None:
            raise StageError(f"dataset.root {manifest}: splits its images in its {SPLIT_COLUMN} column; remove "
                             f"dataset.val_per_class={self.val_per_class:g}, or remove that column to split each "
                             "class by it instead")
        train, val = by_split.pop(Split.TRAIN.value, {}), by_split.pop(Split.VAL.value, {})
        if not train:
            raise StageError(f"dataset.root {manifest}: lists no image whose {SPLIT_COLUMN} is "
                             f"{' or '.join(TRAIN_FOLDERS)}: nothing to train on; mark the training rows so")
        unknown = sorted(set(val) - set(train))
        if unknown:
            raise StageError(f"dataset.root {manifest}: class(es) {', '.join(unknown[:5])} have validation rows but "
                             "none to train on; add their training rows or remove their validation rows")
        self.split = SplitChoice("column", manifest=str(manifest))
        train = _in_label_order(train)
        self.class_names = list(train)
        self.files = {Split.TRAIN: [(path, label) for label, paths in enumerate(train.values()) for path in paths],
                      Split.VAL: [(path, label) for label, name in enumerate(self.class_names)
                                  for path in sorted(val.get(name, []))]}
        self.unread_rows = {split: sum(map(len, classes.values())) for split, classes in sorted(by_split.items())}

    def _class_files(self, folder: Path) -> dict[str, list[str]]:
        """class_files(folder), its folders inside class folders listed in `unread`."""
        classes, nested = class_files(folder)
        self.unread += [os.path.relpath(path, self.root) for path in nested]
        return classes

    def _choose_split(self, root: Path | None) -> SplitChoice:
        """val_per_class if given, else the one the dataset's folder `root` declares in its SPLIT_FILE (none
        for a CSV file), else 0.1."""
        if self.val_per_class is not None:
            return SplitChoice("dataset.val_per_class", self.val_per_class)
        declared = root / SPLIT_FILE if root else None
        if declared is None or not declared.is_file():
            return SplitChoice("default", DEFAULT_VAL_PER_CLASS)
        try:
            value = json.loads(declared.read_text())["val_per_class"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(value)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise StageError(f"{declared} does not declare a split as {{\"val_per_class\": <fraction or count "
                             f">= 0>}} ({type(err).__name__}: {err}); fix or remove the file, or set "
                             "dataset.val_per_class") from None
        return SplitChoice(str(declared), value)

    def _val_count(self, n: int) -> int:
        share = self.split.val_per_class
        if share < 1:
            return int(round(n * share))
        return min(int(share), n)

    def _check_split(self, classes: list[list[str]], counts: list[int]) -> None:
        """A class keeps at least 2 training images and no fewer than it gives to validation."""
        bad = [(name, len(paths), n_val) for name, paths, n_val in zip(self.class_names, classes, counts)
               if n_val and (len(paths) - n_val < 2 or n_val > len(paths) - n_val)]
        if not bad:
            return
        name, n, n_val = bad[0]
        smallest = min(len(paths) for paths in classes if paths)
        largest_count = min(smallest // 2, smallest - 2)
        fix = (f"a count of at most {largest_count}" if largest_count >= 1
               else f"0 (its smallest class has {smallest} images)")
        raise StageError(f"{self.split} takes {n_val} of the {n} images of class {name} for "
                         f"validation, leaving {n - n_val} for training ({len(bad)} of "
                         f"{len(classes)} classes alike); a class needs at least 2 training images and no fewer "
                         f"than it validates on: set dataset.val_per_class to a fraction such as "
                         f"{DEFAULT_VAL_PER_CLASS:g} or {fix}")

    def num_items(self, split: Split) -> int:
        return len(self.files[split])

    def classes_without(self, split: Split, skipped: Collection[str]) -> list[str]:
        """The classes every one of whose `split` files is in `skipped` (could not be used)."""
        usable = {label for path, label in self.files[split] if path not in skipped}
        return sorted({self.class_names[label] for _, label in self.files[split] if label not in usable})

    def num_batches(self, split: Split) -> int:
        return math.ceil(len(self.files[split]) / self.batch_size)

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return Spec(DataKind.ENCODED)

    def order(self, split: Split, epoch: int, seed: int, sequence: int = 0) -> np.ndarray:
        """Item order of an epoch of a sequence: a shuffle keyed by (seed, sequence, epoch) for
        training, fixed for validation."""
        n = len(self.files[split])
        if split is Split.VAL:
            return np.arange(n)
        return shuffle(n, seed, sequence, epoch)

    def items(self, ctx: BatchContext) -> list[tuple[str, int]]:
        """The (path, label) items of the task's share of its batch, in order."""
        order = self.order(ctx.split, ctx.epoch, ctx.seed, ctx.sequence)
        picks = order[ctx.index * self.batch_size:(ctx.index + 1) * self.batch_size]
        return [self.files[ctx.split][i] for i in ctx.share(list(picks))]

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        return read_files(self.items(ctx) if ctx.wanted is None else ctx.wanted, ctx)


def read_files(items: list[tuple[str, int]], ctx: BatchContext) -> Batch:
    """The (path, label) `items`' files as an encoded batch, but those a cache stage downstream holds
    (`ctx.held`); a file that cannot be read is rejected (`ctx.reject`)."""
    data, labels, paths = [], [], []
    for path, label in items:
        if path in ctx.held:
            continue
        try:
            data.append(Path(path).read_bytes())
        except OSError as err:
            ctx.reject(path, f"a symbolic link to {os.readlink(path)}, which is missing (a git-annex or DVC "
                             "file not fetched?)" if os.path.islink(path) and not os.path.exists(path) else
                       f"cannot read: {err.strerror}")
            continue
        labels.append(label)
        paths.append(path)
    return Batch(data, np.asarray(labels, dtype=np.int64), paths)


def class_files(folder: Path) -> tuple[dict[str, list[str]], list[str]]:
    """Each class folder's files (not hidden, nor one the system writes there), by class name, in name order,
    links to nothing among them (git-annex or DVC files not fetched: a batch skips each, saying so); and the
    folders inside class folders, which are not read (the caller says so: nothing is left out unsaid)."""
    classes, nested = {}, []
    for class_dir in sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")):
        with os.scandir(class_dir) as entries:  # each entry's kind from the listing, not a stat a file
            entries = [entry for entry in entries if not hidden(entry.name)]
        classes[class_dir.name] = sorted(entry.path for entry in entries if entry.is_file() or (
            entry.is_symlink() and not entry.is_dir()))  # a link to nothing: neither file nor folder
        nested += sorted(entry.path for entry in entries if entry.is_dir())
    return classes, nested


def is_manifest(root: Path) -> bool:
    """A dataset.root that names a CSV file listing the images (rather than a folder of them)."""
    return root.suffix.lower() == MANIFEST_SUFFIX and not root.is_dir()


def dataset_folder(root: str) -> str:
    """The folder of a dataset.root (a CSV file's own folder) and a separator: what the paths of its images
    are relative to (ctx.root: a stage's per-image randomness does not depend on where the dataset lies)."""
    path = Path(root)
    return os.path.join(str(path.parent if is_manifest(path) else path), "")


def manifest_rows(manifest: Path, key: str) -> tuple[list[tuple[str, str, str]], bool]:
    """A dataset CSV file's (path, label, split) rows, paths made absolute from the file's folder, split
    Split.TRAIN's or Split.VAL's value for the names of TRAIN_FOLDERS and VAL_FOLDERS, "" without a split
    column, else the name given, lowercased; and whether it has one. A UTF-8 file (Excel's byte-order mark
    allowed), its first line the header. A row it cannot use (a field missing or empty, more fields than
    the header, a path listed twice, no such file) is an error naming its line: no image is dropped unsaid.
    `key`: where the file was given (dataset.root), as errors name it."""
    def error(why: str) -> StageError:
        return StageError(f"{key} {manifest}: {why}")

    folder = manifest.parent
    rows, lines = [], {}
    try:
        with open(manifest, newline="", encoding="utf-8-sig") as file:
            reader = csv.reader(file)
            header = [name.strip().lower() for name in next(reader, [])]
            missing = [name for name in MANIFEST_COLUMNS if name not in header]
            if missing:
                raise error(f"its header ({','.join(header) or 'an empty first line'}) names no "
                            f"{' or '.join(missing)} column; its first line must name the columns path (the "
                            f"image file, relative to the CSV file's folder), label (its class) and optionally "
                            f"{SPLIT_COLUMN} ({TRAIN_FOLDERS[0]} or {VAL_FOLDERS[0]})")
            twice = sorted({name for name in header if name in (*MANIFEST_COLUMNS, SPLIT_COLUMN)
                            and header.count(name) > 1})
            if twice:
                raise error(f"its header names the {' and '.join(twice)} column twice; rename or remove one")
            has_split = SPLIT_COLUMN in header
            columns = [header.index(name) for name in (*MANIFEST_COLUMNS, SPLIT_COLUMN) if name in header]
            for fields in reader:
                line = reader.line_num
                if not any(field.strip() for field in fields):
                    continue  # a blank line (an editor's last one)
                if len(fields) > len(header):
                    raise error(f"line {line} has {len(fields)} fields, its header {len(header)}; quote a field "
                                'that holds a comma ("a,b.jpg")')
                values = [fields[i].strip() if i < len(fields) else "" for i in columns]
                empty = [name for name, value in zip((*MANIFEST_COLUMNS, SPLIT_COLUMN), values) if not value]
                if empty:
                    raise error(f"line {line} gives no {' or '.join(empty)}; give every image its "
                                f"{', '.join(name for name in header if name in (*MANIFEST_COLUMNS, SPLIT_COLUMN))}"
                                " or remove the line")
                path = os.path.normpath(os.path.join(folder, values[0]))
                if path in lines:
                    raise error(f"lines {lines[path]} and {line} both list {values[0]}; list each image once")
                lines[path] = line
                split = values[2].lower() if has_split else ""
                split = (Split.TRAIN.value if split in TRAIN_FOLDERS else Split.VAL.value if split in VAL_FOLDERS
                         else split)
                rows.append((path, values[1], split))
    except FileNotFoundError:
        raise error("no such file; give the CSV file listing the images, or a folder of class folders") from None
    except (UnicodeDecodeError, csv.Error) as err:
        raise error(f"not a UTF-8 CSV file ({type(err).__name__}: {err}); save it as CSV (UTF-8)") from None
    except PermissionError as err:
        raise error(f"this user may not read it ({err.strerror}); give it read access (chmod a+r)") from None
    if not rows:
        raise error("lists no images below its header; add a line per image (path,label)")
    absent = [path for path, _, _ in rows if not os.path.isfile(path)]
    if absent:  # found now, not as a read fails mid-epoch
        named = ", ".join(f"{os.path.relpath(path, folder)} (line {lines[path]})" for path in absent[:3])
        raise error(f"{len(absent)} of its {len(rows)} images are not there: {named}; paths are relative to "
                    f"{folder}: fix them, or remove their lines")
    return rows, has_split


def _in_label_order(classes: dict[str, list[str]]) -> dict[str, list[str]]:
    """Classes in label order, each one's paths sorted: by name, or by number where every name is a whole
    number (labels 0, 1, ..., 10 stay the outputs they name)."""
    numbered = all(name.isdecimal() for name in classes)
    return {name: sorted(classes[name]) for name in sorted(classes, key=lambda name: (int(name), name) if numbered
                                                             else name)}


def hidden(name: str) -> bool:
    """A file a dataset's listing leaves out: a hidden one, or one the system writes into folders of pictures."""
    return name.startswith(".") or name.lower() in SYSTEM_FILES


def _check_no_empty_class(folder: Path, classes: dict[str, list[str]]) -> None:
    """A class folder without a file to train on is an error naming it (a copy cut short, most likely): its
    class would be one more output that no image teaches. (No class with files: _scan says so instead.)"""
    empty = [name for name, paths in classes.items() if not paths]
    if empty and len(empty) < len(classes):
        named = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise StageError(f"class folder(s) {named} of {folder} hold no files to train on ({len(empty)} of "
                         f"{len(classes)} classes; hidden files and folders inside a class folder are not read): "
                         "add the class's images or remove its folder")


def _split_folders(root: Path) -> tuple[Path, Path] | None:
    """The (train, val) folders of a dataset split in folders; None for one folder of classes. `root` is
    split in folders when it holds a folder of class folders named as a training folder (TRAIN_FOLDERS):
    then a validation folder of class folders (VAL_FOLDERS) must be beside it, or it is an error naming
    the fix (ImageNet's val/ as downloaded holds its images flat: read as one folder of classes, train/
    and val/ would be two classes)."""
    train = _folder_of_classes(root, TRAIN_FOLDERS)
    if train is None:
        return None
    val = _folder_of_classes(root, VAL_FOLDERS)
    if val is None:
        named = next((root / name for name in VAL_FOLDERS if (root / name).is_dir()), None)
        why = (f"{named} holds no class folders (ImageNet's val/ as downloaded is flat)" if named else
               f"no validation folder beside it ({', '.join(f'{name}/' for name in VAL_FOLDERS)})")
        raise StageError(f"dataset root {root} holds a training folder of classes, {train}, but {why}; arrange "
                         f"the validation images as {named or root / VAL_FOLDERS[0]}/<class>/<image>, or set "
                         f"dataset.root={train} to split its classes by dataset.val_per_class")
    return train, val


def _folder_of_classes(root: Path, names: tuple[str, ...]) -> Path | None:
    """The first of `names` under `root` that holds a folder (not hidden): a folder of class folders (one
    of images, as a class called "train" is, holds none)."""
    for name in names:
        folder = root / name
        if folder.is_dir() and any(child.is_dir() and not child.name.startswith(".") for child in folder.iterdir()):
            return folder
    return None


# Epochs whose shuffles a worker keeps: a few flotillas' current and next epochs. At ImageNet's 1.28M
# files one is 5 MB (uint32).
SHUFFLES_KEPT = 8


@functools.lru_cache(maxsize=SHUFFLES_KEPT)
def shuffle(n: int, seed: int, sequence: int, epoch: int) -> np.ndarray:
    """The order of n training items in an epoch, computed once per worker process and kept: every
    batch task of the epoch slices it, so an epoch costs O(n), not O(n) per batch (63 ms a task at
    1.28M files). A pure function of its arguments: tasks stay independent of each other."""
    order = np.random.default_rng([seed, sequence, epoch]).permutation(n)
    order = order.astype(np.uint32 if n < 2**32 else np.int64)
    order.flags.writeable = False  # shared by every task that asks
    return order

