"""Stage behaviour, and a suite every stage must pass: the output matches the
declared spec, the same seed gives the same bytes, the stage pickles."""
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageOps

from stages.augment import RandomResizedCropFlip
from stages.base import BadFileError, Batch, BatchContext, DataKind, Spec, Split, StageError
from stages.decode import Decode, DaliRejected, _decode_with_dali, _jpeg_orientation
from stages.read import SPLIT_FILE, ImageFolder, shuffle
from stages.broadcast import Broadcast
from tests.conftest import as_a_user_permissions_bind


def ctx(split=Split.TRAIN, epoch=0, index=0, seed=0, on_error="skip", stage="s"):
    return BatchContext(seed=seed, split=split, epoch=epoch, index=index, on_error=on_error, stage=stage)


@pytest.fixture
def source(tiny_dataset):
    return ImageFolder(root=str(tiny_dataset), batch_size=8, val_per_class=0.25)


def chain(source, decode=None, augment=None):
    """(stage, input batch factory) for each built-in stage."""
    decode = decode or Decode()
    augment = augment or RandomResizedCropFlip(size=32)
    encoded = lambda c: source(None, c)
    decoded = lambda c: decode(encoded(c), c)
    cropped = lambda c: augment(decoded(c), c)
    return [(source, lambda c: None, None), (decode, encoded, Spec(DataKind.ENCODED)),
            (augment, decoded, Spec(DataKind.IMAGES)), (Broadcast(), cropped, Spec(DataKind.TENSOR, (32, 32, 3)))]


def conforms(batch: Batch, spec: Spec) -> bool:
    if spec.kind is DataKind.ENCODED:
        return all(isinstance(d, bytes) for d in batch.data)
    if spec.kind is DataKind.IMAGES:
        return all(d.dtype == np.uint8 and d.ndim == 3 and d.shape[2] == 3 for d in batch.data)
    return batch.data.dtype == np.uint8 and batch.data.shape[1:] == spec.item_shape


@pytest.mark.parametrize("position", range(4))
def test_every_stage_matches_its_spec_is_deterministic_and_pickles(source, position):
    stage, make_input, input_spec = chain(source)[position]
    spec = stage.output_spec(input_spec)
    first = stage(make_input(ctx()), ctx())
    again = pickle.loads(pickle.dumps(stage))(make_input(ctx()), ctx())
    assert conforms(first, spec)
    assert len(first.labels) == len(first.paths) == len(first.data) == 8
    for a, b in zip(first.data, again.data):
        assert np.array_equal(np.asarray(a if not isinstance(a, bytes) else np.frombuffer(a, np.uint8)),
                              np.asarray(b if not isinstance(b, bytes) else np.frombuffer(b, np.uint8)))


def test_split_is_fixed_per_class_by_fraction_and_count(tiny_dataset):
    by_fraction = ImageFolder(root=str(tiny_dataset), batch_size=8, val_per_class=0.25)
    by_count = ImageFolder(root=str(tiny_dataset), batch_size=8, val_per_class=4)
    assert by_fraction.num_items(Split.VAL) == by_count.num_items(Split.VAL) == 4 * 4
    assert by_fraction.files == by_count.files
    train = {p for p, _ in by_fraction.files[Split.TRAIN]}
    assert train.isdisjoint(p for p, _ in by_fraction.files[Split.VAL])
    assert len(train) == 4 * 12


def test_a_dataset_declares_its_split_and_val_per_class_overrides_it(tiny_dataset, tmp_path):
    assert ImageFolder(root=str(tiny_dataset), batch_size=8).num_items(Split.VAL) == 4 * 2  # 10% of 16
    root = tmp_path / "declared"
    shutil.copytree(tiny_dataset, root)
    (root / SPLIT_FILE).write_text('{"val_per_class": 0.25}')
    declared = ImageFolder(root=str(root), batch_size=8)
    assert declared.num_items(Split.VAL) == 4 * 4
    assert declared.split.summary() == {"source": str(root / SPLIT_FILE), "val_per_class": 0.25}
    assert str(declared.split) == f"val_per_class=0.25 declared in {root / SPLIT_FILE}"
    assert ImageFolder(root=str(root), batch_size=8, val_per_class=0.1).num_items(Split.VAL) == 4 * 2
    assert ImageFolder(root=str(root), batch_size=8, val_per_class=0).num_items(Split.VAL) == 0
    (root / SPLIT_FILE).write_text('{"val_per_class": "most"}')
    with pytest.raises(StageError, match=r"split.json does not declare a split .*set dataset.val_per_class"):
        ImageFolder(root=str(root), batch_size=8)


@pytest.mark.parametrize("val_per_class, taken, left", [(15, 15, 1), (16, 16, 0), (40, 16, 0), (9, 9, 7), (0.6, 10, 6)])
def test_a_split_that_takes_most_of_a_class_is_an_error_naming_the_key_and_the_fix(tiny_dataset, val_per_class,
                                                                                    taken, left):
    with pytest.raises(StageError) as error:
        ImageFolder(root=str(tiny_dataset), batch_size=8, val_per_class=val_per_class)
    message = str(error.value)
    assert f"val_per_class={val_per_class:g} (dataset.val_per_class) takes {taken} of the 16 images of class 001." \
        in message
    assert f"leaving {left} for training (4 of 4 classes alike)" in message
    assert message.endswith("set dataset.val_per_class to a fraction such as 0.1 or a count of at most 8")
    assert ImageFolder(root=str(tiny_dataset), batch_size=8, val_per_class=8).num_items(Split.TRAIN) == 4 * 8


def test_a_class_too_small_for_any_validation_image_says_so(tmp_path):
    for name, count in (("001.a", 2), ("002.b", 10)):
        (tmp_path / name).mkdir()
        for i in range(count):
            (tmp_path / name / f"{i}.jpg").write_bytes(b"x")
    with pytest.raises(StageError, match=r"takes 1 of the 2 images of class 001.a for validation, leaving 1 .* "
                                         r"or 0 \(its smallest class has 2 images\)"):
        ImageFolder(root=str(tmp_path), batch_size=8, val_per_class=1)
    assert ImageFolder(root=str(tmp_path), batch_size=8).num_items(Split.VAL) == 1  # round(0.2) + round(1.0)


def _split_in_folders(tiny_dataset, root, val_name="val", val_classes=3):
    """The tiny dataset as ImageNet and Imagenette ship theirs: train/<class>/ (12 of each class's images) and
    <val_name>/<class>/ (4, for the first `val_classes` classes), a test/ folder and a file beside them."""
    for rank, class_dir in enumerate(sorted(p for p in tiny_dataset.iterdir() if p.is_dir())):
        files = sorted(class_dir.iterdir())
        for folder, chosen in (("train", files[:12]), (val_name, files[12:] if rank < val_classes else None),
                               ("test", files[12:])):
            if chosen is None:
                continue
            (root / folder / class_dir.name).mkdir(parents=True, exist_ok=True)
            for file in chosen:
                shutil.copy(file, root / folder / class_dir.name / file.name.replace(".jpg", ".JPEG"))
    (root / "noisy_labels.csv").write_text("path,label\n")
    return root


@pytest.mark.parametrize("val_name", ["val", "validation"])
def test_a_dataset_split_in_folders_trains_on_its_train_folder_and_validates_on_its_val_folder(
        tiny_dataset, tmp_path, val_name):
    root = _split_in_folders(tiny_dataset, tmp_path / "imagenette", val_name)
    source = ImageFolder(root=str(root), batch_size=8)
    names = sorted(p.name for p in tiny_dataset.iterdir() if p.is_dir())
    assert source.class_names == names
    assert str(source.split) == f"the dataset's own train/ and {val_name}/ folders"
    assert source.split.summary() == {"source": "folders", "folders": ("train", val_name)}
    for split, folder, count in ((Split.TRAIN, "train", 4 * 12), (Split.VAL, val_name, 3 * 4)):
        files = source.files[split]
        assert len(files) == count  # test/ is not read; the fourth class has no folder in val/
        assert all(path.startswith(str(root / folder / names[label]) + "/") for path, label in files), files
    # The validation images are those of val/ (what a run validates on), read as any batch.
    batch = source(None, ctx(split=Split.VAL))
    assert batch.paths == [path for path, _ in source.files[Split.VAL][:8]] and len(batch.data) == 8


def test_a_dataset_split_in_folders_refuses_a_second_split_and_classes_it_cannot_train(tiny_dataset, tmp_path):
    root = _split_in_folders(tiny_dataset, tmp_path / "imagenette")
    with pytest.raises(StageError, match=rf"dataset root {root} is split in folders \(train/ and val/\), so its "
                                         rf"validation images are those in {root / 'val'}; remove "
                                         rf"dataset.val_per_class=0.2, or point dataset.root at {root / 'train'}"):
        ImageFolder(root=str(root), batch_size=8, val_per_class=0.2)
    assert ImageFolder(root=str(root / "train"), batch_size=8, val_per_class=0.25).num_items(Split.VAL) == 4 * 3
    (root / SPLIT_FILE).write_text('{"val_per_class": 0.25}')
    with pytest.raises(StageError, match=rf"also declares a split in {root / SPLIT_FILE}; remove that file"):
        ImageFolder(root=str(root), batch_size=8)
    (root / SPLIT_FILE).unlink()
    (root / "val" / "999.stray").mkdir()
    (root / "val" / "999.stray" / "a.jpg").write_bytes(b"x")
    with pytest.raises(StageError, match=rf"class folder\(s\) 999.stray of {root / 'val'} have none in "
                                         rf"{root / 'train'} to train on"):
        ImageFolder(root=str(root), batch_size=8)
    # ImageNet's val/ as downloaded: its images flat, not in class folders (read as one folder of classes,
    # train/ and val/ were two classes: a 2-class model trained on the validation images)
    shutil.rmtree(root / "val")
    (root / "val").mkdir()
    shutil.copy(next((root / "train").glob("*/*.JPEG")), root / "val" / "ILSVRC2012_val_00000001.JPEG")
    with pytest.raises(StageError, match=rf"holds a training folder of classes, {root / 'train'}, but "
                                         rf"{root / 'val'} holds no class folders \(ImageNet's val/ as downloaded is "
                                         rf"flat\); arrange the validation images as {root / 'val'}/<class>/<image>, "
                                         rf"or set dataset.root={root / 'train'} to split its classes"):
        ImageFolder(root=str(root), batch_size=8)
    shutil.rmtree(root / "val")  # train/ and test/ alone (Kaggle's layout): test/ is no validation folder
    with pytest.raises(StageError, match=r"but no validation folder beside it \(val/, valid/, validation/\); "
                                         rf"arrange the validation images as {root / 'val'}/<class>/<image>"):
        ImageFolder(root=str(root), batch_size=8)


def test_a_folder_inside_a_class_folder_is_not_read_and_is_listed(tiny_dataset, tmp_path):
    """Caltech-256 ships 056.dog/greg: its files are not the class's (as torchvision's Caltech256 reads
    it), and the run says so (`unread`, the first line and results.json) instead of leaving them out unsaid."""
    root = tmp_path / "caltech"
    shutil.copytree(tiny_dataset, root)
    dog = sorted(p for p in root.iterdir() if p.is_dir())[1]
    (dog / "greg").mkdir()
    shutil.copy(next(dog.glob("*.jpg")), dog / "greg" / "extra.jpg")
    (dog / ".hidden").mkdir()
    source = ImageFolder(root=str(root), batch_size=8)
    assert source.unread == [f"{dog.name}/greg"]
    assert source.num_items(Split.TRAIN) + source.num_items(Split.VAL) == 4 * 16  # greg's file is not among them
    assert ImageFolder(root=str(tiny_dataset), batch_size=8).unread == []


def test_the_files_windows_writes_into_picture_folders_are_not_read(tiny_dataset, tmp_path):
    """Thumbs.db and desktop.ini in every class folder (a dataset copied from Windows): not among the
    class's files, as hidden files are not. They were: each took a place in the split (a validation one,
    at times, leaving a class none), then was skipped as no image every epoch, and stopped a run under
    on_error=fail."""
    root = tmp_path / "copied"
    shutil.copytree(tiny_dataset, root)
    for folder in (p for p in root.iterdir() if p.is_dir()):
        (folder / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
        (folder / "desktop.ini").write_text("[.ShellClassInfo]\n")
    relative = lambda base: {split: [(os.path.relpath(path, base), label) for path, label in files]
                             for split, files in ImageFolder(root=str(base), batch_size=8).files.items()}
    assert relative(root) == relative(tiny_dataset)  # the same split, file for file


def test_a_class_folder_without_files_is_an_error_naming_it(tiny_dataset, tmp_path):
    """A class folder with nothing to train on (a copy cut short; only hidden files, or only a folder) would
    be one more output no image teaches: an error naming it, in one folder of classes and in train/ of a
    dataset split in folders; one without validation images in val/ is no error."""
    root = tmp_path / "caltech"
    shutil.copytree(tiny_dataset, root)
    (root / "000.empty").mkdir()
    (root / "999.only_hidden" / "greg").mkdir(parents=True)
    (root / "999.only_hidden" / ".DS_Store").write_bytes(b"x")
    with pytest.raises(StageError, match=rf"^class folder\(s\) 000.empty, 999.only_hidden of {root} hold no files to "
                                         r"train on \(2 of 6 classes; hidden files and folders inside a class folder "
                                         r"are not read\): add the class's images or remove its folder$"):
        ImageFolder(root=str(root), batch_size=8)
    split = _split_in_folders(tiny_dataset, tmp_path / "imagenette")
    (split / "val" / sorted(p.name for p in tiny_dataset.iterdir() if p.is_dir())[3]).mkdir()  # no validation images
    assert ImageFolder(root=str(split), batch_size=8).num_items(Split.VAL) == 3 * 4
    (split / "train" / "000.empty").mkdir()
    with pytest.raises(StageError, match=rf"^class folder\(s\) 000.empty of {split / 'train'} hold no files"):
        ImageFolder(root=str(split), batch_size=8)


def test_the_classes_every_training_file_of_which_was_skipped_are_named(tmp_path):
    """Known only once its files are decoded: a class none of whose training files can be used (its
    validation files do not count; one usable training file is enough)."""
    for name in ("001.fine", "002.unreadable"):
        (tmp_path / name).mkdir()
        for i in range(5):
            (tmp_path / name / f"{i}.jpg").write_bytes(b"x")
    source = ImageFolder(root=str(tmp_path), batch_size=8, val_per_class=1)
    unreadable = {path for path, label in source.files[Split.TRAIN] if label == 1}
    val = {path for path, _ in source.files[Split.VAL]}
    assert len(unreadable) == 4 and source.classes_without(Split.TRAIN, unreadable | val) == ["002.unreadable"]
    one_left = set(sorted(unreadable)[1:])
    assert source.classes_without(Split.TRAIN, val) == source.classes_without(Split.TRAIN, one_left) == []
    assert source.classes_without(Split.VAL, val) == ["001.fine", "002.unreadable"]


def test_classes_called_train_and_val_are_one_folder_of_classes(tmp_path):
    for name in ("train", "val"):
        (tmp_path / name).mkdir()
        for i in range(10):
            (tmp_path / name / f"{i}.jpg").write_bytes(b"x")
    source = ImageFolder(root=str(tmp_path), batch_size=8)
    assert source.class_names == ["train", "val"] and source.num_items(Split.VAL) == 2


def _listed(tiny_dataset, manifest: Path, header="path,label", extra=lambda path: "") -> None:
    """tiny_dataset's images in the CSV file `manifest`, paths relative to its folder, labels their folders'."""
    lines = [header] + [f"{os.path.relpath(path, manifest.parent)},{path.parent.name}{extra(path)}"
                        for path in sorted(tiny_dataset.glob("*/*.jpg"))]
    manifest.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("val_per_class", [None, 0.25])
def test_a_csv_file_without_a_split_column_splits_and_reads_its_images_as_their_folder_does(
        tiny_dataset, tmp_path, val_per_class):
    """dataset.root=<file>.csv listing a folder of classes' images: the same classes, split and batches."""
    manifest = tmp_path / "images.csv"
    _listed(tiny_dataset, manifest)
    listed = ImageFolder(root=str(manifest), batch_size=8, val_per_class=val_per_class)
    folder = ImageFolder(root=str(tiny_dataset), batch_size=8, val_per_class=val_per_class)
    assert listed.class_names == folder.class_names and listed.files == folder.files
    assert listed.split == folder.split and listed.unread_rows == {}
    assert listed.prefix == f"{tmp_path}/"  # what its paths are relative to
    batch = folder(None, ctx())
    assert listed(None, ctx()).paths == batch.paths and len(batch.data) == 8


def test_a_csv_file_with_a_split_column_trains_and_validates_on_its_rows(tiny_manifest):
    source = ImageFolder(root=str(tiny_manifest), batch_size=8)
    assert str(source.split) == f"the split column of {tiny_manifest}"
    assert source.split.summary() == {"source": "column", "manifest": str(tiny_manifest)}
    assert source.num_items(Split.TRAIN) == 4 * 12 and source.num_items(Split.VAL) == 4 * 3
    assert source.unread_rows == {"test": 4}
    rows = [line.split(",") for line in tiny_manifest.read_text().splitlines()[1:]]
    for split in Split:
        expected = sorted((os.path.normpath(tiny_manifest.parent / path), source.class_names.index(label))
                          for path, label, given in rows if given == split.value)
        assert sorted(source.files[split]) == expected
    batch = source(None, ctx(split=Split.VAL))
    assert batch.paths == [path for path, _ in source.files[Split.VAL][:8]] and len(batch.data) == 8
    with pytest.raises(StageError, match=rf"^dataset.root {tiny_manifest}: splits its images in its split column; remove "
                                         r"dataset.val_per_class=0.2, or remove that column"):
        ImageFolder(root=str(tiny_manifest), batch_size=8, val_per_class=0.2)


def test_a_csv_file_as_spreadsheets_save_it_is_read(tiny_dataset, tmp_path):
    """Excel's "CSV UTF-8": a byte-order mark, CRLF line ends, its own capitalisation of the header, columns
    the run does not read (one quoted, holding commas), Validation and Train as split names, a blank last
    line; labels that are numbers are ordered as numbers (class 10 after class 2)."""
    folders = sorted(path.name for path in tiny_dataset.iterdir() if path.is_dir())
    labels = dict(zip(folders, ("2", "10", "1", "3")))
    lines = ["Notes,Label,Path,Split"]
    for index, path in enumerate(sorted(tiny_dataset.glob("*/*.jpg"))):
        lines.append(f'"seen, once",{labels[path.parent.name]},{path},{"Validation" if index % 4 == 0 else "Train"}')
    manifest = tmp_path / "Export.CSV"
    manifest.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines + ["", ""]).encode())
    source = ImageFolder(root=str(manifest), batch_size=8)
    assert source.class_names == ["1", "2", "3", "10"]
    assert source.num_items(Split.TRAIN) == 48 and source.num_items(Split.VAL) == 16
    for split in Split:  # absolute paths as given, each with its folder's label
        assert all(source.class_names[label] == labels[Path(path).parent.name] for path, label in source.files[split])


@pytest.mark.parametrize("text, error", [
    ("path,class\na.jpg,x\n", r"its header \(path,class\) names no label column; its first line must name the "
                              r"columns path \(the image file, relative to the CSV file's folder\), label"),
    ("", r"its header \(an empty first line\) names no path or label column"),
    ("path,label\n", r"lists no images below its header; add a line per image \(path,label\)"),
    ("path,label,Path\n{a},x,{b}\n", r"its header names the path column twice; rename or remove one"),
    ("path,label\n{a},x\n{b},\n", r"line 3 gives no label; give every image its path, label or remove the line"),
    ("path,label\n{a},x,y\n", r"line 2 has 3 fields, its header 2; quote a field that holds a comma"),
    ("path,label\n{a},x\n\n./{a},y\n", r"lines 2 and 4 both list ./a.jpg; list each image once"),
    ("path,label\n{a},x\n{b},x\nmissing.jpg,x\n", r"1 of its 3 images are not there: missing.jpg \(line 4\); paths "
                                                  r"are relative to {folder}: fix them, or remove their lines"),
    ("path,label,split\n{a},x,val\n{b},y,train\n", r"class\(es\) x have validation rows but none to train on"),
    ("path,label,split\n{a},x,val\n{b},x,test\n", r"lists no image whose split is train or training: nothing to "
                                                  r"train on"),
    (b"path,label\n{a},caf\xe9\n", r"not a UTF-8 CSV file \(UnicodeDecodeError: .*\); save it as CSV \(UTF-8\)"),
])
def test_a_csv_file_the_run_cannot_use_is_an_error_naming_it_its_line_and_the_fix(tmp_path, text, error):
    for name in ("a.jpg", "b.jpg"):
        (tmp_path / name).write_bytes(b"x")
    manifest = tmp_path / "images.csv"
    fill = dict(a="a.jpg", b="b.jpg")
    if isinstance(text, bytes):
        manifest.write_bytes(text.replace(b"{a}", b"a.jpg"))
    else:
        manifest.write_text(text.format(**fill))
    with pytest.raises(StageError, match=rf"^dataset.root {re.escape(str(manifest))}: "
                                         rf"{error.format(folder=re.escape(str(tmp_path)))}"):
        ImageFolder(root=str(manifest), batch_size=8)


def test_a_csv_root_that_is_not_there_is_an_error_and_no_stand_in_is_made_there(tmp_path):
    from pipeline.data.dataset import DatasetError, Synthetic, prepare_dataset

    manifest = tmp_path / "images.csv"
    with pytest.raises(StageError, match=rf"^dataset.root {manifest}: no such file; give the CSV file listing"):
        ImageFolder(root=str(manifest), batch_size=8)
    with pytest.raises(DatasetError, match=rf"^dataset.root {manifest}: no such file; set dataset.root to the "
                                           r"CSV file listing the images \(path,label\[,split\]\)"):
        prepare_dataset(str(manifest), Synthetic.auto, 3, 4, 0.0)
    assert list(tmp_path.iterdir()) == []


def test_training_order_changes_with_epoch_and_seed_but_not_otherwise(source):
    order = lambda epoch, seed: source.order(Split.TRAIN, epoch, seed).tolist()
    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(1, 0) and order(0, 0) != order(0, 1)
    assert sorted(order(1, 0)) == list(range(source.num_items(Split.TRAIN)))
    assert source.order(Split.VAL, 3, 5).tolist() == list(range(source.num_items(Split.VAL)))


def test_an_epoch_covers_every_training_file_once(source):
    paths = [p for i in range(source.num_batches(Split.TRAIN)) for p in source(None, ctx(index=i)).paths]
    assert sorted(paths) == sorted(p for p, _ in source.files[Split.TRAIN])


def test_an_epochs_shuffle_is_computed_once_for_all_its_batch_tasks(source):
    """Linear cost: every batch task of an epoch slices one kept permutation (it was one per task)."""
    shuffle.cache_clear()
    batches = [source(None, ctx(index=i, epoch=7)) for i in range(source.num_batches(Split.TRAIN))]
    assert shuffle.cache_info().misses == 1 and shuffle.cache_info().hits == len(batches) - 1
    fresh = np.random.default_rng([0, 0, 7]).permutation(source.num_items(Split.TRAIN))  # the order it keeps
    assert [p for b in batches for p in b.paths] == [source.files[Split.TRAIN][i][0] for i in fresh]


def test_augmentations_follow_seed_epoch_and_index(source):
    stage, make_input, _ = chain(source)[2]
    run = lambda **k: stage(make_input(ctx(**k)), ctx(**k)).data
    assert not np.array_equal(run(seed=0), run(seed=1))
    assert not np.array_equal(run(epoch=0), run(epoch=1))


def test_validation_is_center_crop_without_randomness():
    image = np.arange(100 * 200 * 3, dtype=np.uint8).reshape(100, 200, 3)
    batch = Batch([image], np.zeros(1, np.int64), ["x.jpg"])
    crop = RandomResizedCropFlip(size=100, crop_fraction=1.0)
    out = crop(batch, ctx(split=Split.VAL, seed=1)).data[0]
    assert np.array_equal(out, crop(batch, ctx(split=Split.VAL, seed=2)).data[0])
    assert np.array_equal(out, image[:, 50:150])  # the centred square, same size: copied as is


def test_random_crop_flips_about_half_the_time(source):
    image = np.tile(np.arange(64, dtype=np.uint8)[None, :, None], (64, 1, 3))
    batch = Batch([image] * 400, np.zeros(400, np.int64), [f"x{i}.jpg" for i in range(400)])  # seeded per file
    out = RandomResizedCropFlip(size=16, scale=(1.0, 1.0), ratio=(1.0, 1.0))(batch, ctx()).data
    flipped = out[:, 0, 0, 0] > out[:, 0, -1, 0]
    assert 150 < flipped.sum() < 250


def test_reduced_dct_decode_keeps_the_side_consumers_need(source):
    data = source(None, ctx()).data[0]
    full = simplejpeg.decode_jpeg(data)
    decode = Decode()
    decode.set_consumer_need(50)
    reduced = decode(Batch([data], np.zeros(1, np.int64), ["x"]), ctx()).data[0]
    assert min(reduced.shape[:2]) >= 50 and reduced.shape[0] < full.shape[0]
    assert Decode(min_size=None).keep_side == 0  # no consumer told: full size


def test_dali_and_simplejpeg_decode_alike_and_give_the_same_crops(source):
    encoded = source(None, ctx())
    by_turbo = Decode(backend="simplejpeg")(encoded, ctx())
    by_dali = Decode(backend="dali")(encoded, ctx())
    for a, b in zip(by_turbo.data, by_dali.data):
        assert a.shape == b.shape
        assert np.abs(a.astype(int) - b.astype(int)).mean() < 1.0
    crop = RandomResizedCropFlip(size=32)
    a, b = crop(by_turbo, ctx(stage="crop")).data, crop(by_dali, ctx(stage="crop")).data
    assert np.abs(a.astype(int) - b.astype(int)).mean() < 1.0


def decode_all(root, backend, on_error="skip"):
    source = ImageFolder(root=str(root), batch_size=1000, val_per_class=0)
    c = ctx(on_error=on_error)
    return Decode(backend=backend)(source(None, c), c), c


@pytest.mark.parametrize("backend", ["simplejpeg", "pillow", "dali"])
def test_bad_files_are_skipped_and_listed_or_converted(bad_dataset, backend):
    root, bad = bad_dataset
    batch, c = decode_all(root, backend)
    skipped = dict(c.skipped)
    for kind in ("corrupt", "truncated", "empty", "non_image"):
        assert str(bad[kind]) in skipped, kind
    converted = dict(c.converted)
    for kind in ("grayscale", "cmyk", "png_named_jpg"):
        assert str(bad[kind]) in batch.paths, kind  # readable images are kept, in RGB
    assert "PNG data in a .jpg file" in converted[str(bad["png_named_jpg"])]
    assert "empty" in skipped[str(bad["empty"])] and "not an image" in skipped[str(bad["non_image"])]
    assert all(image.shape[2] == 3 for image in batch.data)
    assert len(batch.data) == 4 * 16 + 3


@pytest.mark.parametrize("backend", ["simplejpeg", "pillow", "dali"])
def test_deep_grey_images_keep_their_scale_or_are_skipped_saying_why(tmp_path, backend):
    """16-bit grey (PNG, TIFF: medical and satellite images) becomes 8-bit RGB by its high byte, as 16-bit
    colour does, not by Pillow's own conversion, which clips at 255 (a white image); 32-bit grey converts
    where its values lie in 0-255, and is skipped naming its range where they do not (no scale known)."""
    ramp = np.arange(0, 65536, 257, dtype=np.uint16).reshape(16, 16)  # 0, 257, ..., 65535: 8-bit 0..255
    folder = tmp_path / "001.deep"
    folder.mkdir()
    Image.fromarray(ramp).save(folder / "ramp16.png")
    Image.fromarray(ramp).save(folder / "ramp16.tif")
    Image.fromarray((ramp // 257).astype(np.int32)).save(folder / "small32.tif")
    Image.fromarray(ramp.astype(np.float32)).save(folder / "wide32.tif")
    batch, c = decode_all(tmp_path, backend)
    expected = np.repeat((ramp // 257).astype(np.uint8)[..., None], 3, axis=2)
    decoded = dict(zip(batch.paths, batch.data))
    for name in ("ramp16.png", "ramp16.tif", "small32.tif"):
        assert decoded[str(folder / name)].dtype == np.uint8
        assert np.array_equal(decoded[str(folder / name)], expected), name
    converted = dict(c.converted)
    assert re.fullmatch(r"PNG I(;16)? scaled to 8 bits and converted to RGB", converted[str(folder / "ramp16.png")])
    assert converted[str(folder / "small32.tif")] == "TIFF I converted to RGB"
    assert c.skipped == [(str(folder / "wide32.tif"), "TIFF F: 32-bit values from 0 to 65535, whose 8-bit scale "
                                                      "is not known; save the image with 8 or 16 bits per channel")]


def test_the_orientation_tag_is_read_as_writers_store_it_and_nonsense_is_as_stored():
    """Big- and little-endian EXIF, the tag a SHORT (the standard's) or a LONG (some writers'); XMP's
    tiff:Orientation, an attribute or an element, where EXIF has no tag (as Pillow reads them: the first
    EXIF block, the last XMP packet); a segment cut short, a value out of range, neither: 1, as stored."""
    def app1(body: bytes) -> bytes:
        return b"\xff\xe1" + (len(body) + 2).to_bytes(2, "big") + body

    def exif(order: str, kind: int, value: int, cut: int = 0) -> bytes:
        b = "big" if order == "MM" else "little"
        field = value.to_bytes({1: 1, 4: 4, 9: 4}.get(kind, 2), b).ljust(4, b"\0")
        tiff = (order.encode() + (42).to_bytes(2, b) + (8).to_bytes(4, b) + (1).to_bytes(2, b) +
                (0x0112).to_bytes(2, b) + kind.to_bytes(2, b) + (1).to_bytes(4, b) + field + bytes(4))
        return app1(b"Exif\0\0" + tiff[:len(tiff) - cut])

    def xmp(orientation: str) -> bytes:
        return app1(b"http://ns.adobe.com/xap/1.0/\0<x:xmpmeta><rdf:Description " + orientation.encode() + b"/>")

    def jpeg(*segments: bytes) -> bytes:
        return b"\xff\xd8" + b"".join(segments) + b"\xff\xda\0\2"

    for order in ("MM", "II"):
        for kind in (3, 4, 8, 9):  # SHORT, LONG, and their signed kinds
            assert _jpeg_orientation(jpeg(exif(order, kind, 6))) == 6, (order, kind)
        assert _jpeg_orientation(jpeg(exif(order, 1, 6), xmp('tiff:Orientation="3"'))) == 1  # a BYTE: no number
    assert _jpeg_orientation(jpeg(exif("MM", 3, 9))) == 1
    assert _jpeg_orientation(jpeg(exif("II", 3, 6, cut=12))) == 1
    assert _jpeg_orientation(b"\xff\xd8\xff\xe0\0\4ab\xff\xda") == 1
    assert _jpeg_orientation(jpeg(xmp('tiff:Orientation="8"'))) == 8
    assert _jpeg_orientation(jpeg(xmp("><tiff:Orientation>5</tiff:Orientation"))) == 5
    assert _jpeg_orientation(jpeg(xmp('tiff:Orientation="6"'), xmp('tiff:Orientation="3"'))) == 3
    assert _jpeg_orientation(jpeg(xmp('tiff:Orientation="6"'), xmp("tiff:Make='x'"))) == 1
    assert _jpeg_orientation(jpeg(exif("II", 3, 1), xmp('tiff:Orientation="6"'))) == 1  # EXIF's tag counts
    assert _jpeg_orientation(jpeg(exif("II", 3, 6, cut=12), xmp('tiff:Orientation="6"'))) == 6  # EXIF has none
    assert _jpeg_orientation(jpeg(xmp('tiff:Orientation="7"'), exif("MM", 3, 6, cut=12))) == 7
    assert _jpeg_orientation(jpeg(xmp('tiff:Orientation="9"'))) == 1


@pytest.mark.parametrize("backend", ["simplejpeg", "pillow", "dali"])
def test_an_image_past_pillows_size_limit_is_skipped_saying_so(tmp_path, backend):
    """Pillow refuses to open an image of more than 179 million pixels (a gigapixel scan: gigabytes once
    decoded), raising an error of its own that stopped the run with a traceback: the file is skipped and
    listed, saying why and what to do."""
    (tmp_path / "001.scans").mkdir()
    Image.new("L", (14000, 13000)).save(tmp_path / "001.scans" / "huge.png")  # 182 Mpx: 200 KB of PNG
    batch, c = decode_all(tmp_path, backend)
    ((path, reason),) = c.skipped
    assert batch.paths == [] and path == str(tmp_path / "001.scans" / "huge.png")
    assert re.fullmatch(r"too large to decode: .*\b182000000 pixels.*; downscale it", reason), reason


@pytest.mark.parametrize("backend", ["simplejpeg", "pillow", "dali"])
def test_a_jpeg_past_the_size_limit_is_skipped_by_every_backend_unless_decoded_smaller(tmp_path, backend,
                                                                                        monkeypatch):
    """Pillow's size limit held only for what Pillow decodes: simplejpeg and DALI decoded a gigapixel JPEG
    whole (gigabytes in a worker). Every backend now refuses a JPEG past it, in Pillow's words; simplejpeg
    keeps a sequential one it decodes at a reduced DCT scale to fewer pixels than the limit, never a
    progressive one (libjpeg-turbo holds all of its coefficients whatever the scale). (The limit lowered
    to 2,000 pixels: real gigapixel JPEGs take seconds and gigabytes to make.)"""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses past twice this
    folder = tmp_path / "001.scans"
    folder.mkdir()
    for name, (height, width) in {"large.jpg": (50, 60), "small.jpg": (20, 40)}.items():
        pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
        (folder / name).write_bytes(simplejpeg.encode_jpeg(pixels))
    refusal = "too large to decode: Image size (3000 pixels) exceeds limit of 2000 pixels; downscale it"
    batch, c = decode_all(tmp_path, backend)
    assert batch.paths == [str(folder / "small.jpg")] and c.skipped == [(str(folder / "large.jpg"), refusal)]
    if backend == "simplejpeg":  # a shorter side of 8 is kept at a quarter of the large: 13 x 15
        large = simplejpeg.decode_jpeg((folder / "large.jpg").read_bytes())
        Image.fromarray(large).save(folder / "progressive.jpg", progressive=True)
        source = ImageFolder(root=str(tmp_path), batch_size=1000, val_per_class=0)
        batch = Decode(backend=backend, min_size=8)(source(None, c := ctx()), c)
        assert sorted(image.shape for image in batch.data) == [(10, 20, 3), (13, 15, 3)]
        assert c.skipped == [(str(folder / "progressive.jpg"), refusal)]


@pytest.mark.parametrize("backend", ["simplejpeg", "pillow", "dali"])
def test_photos_are_decoded_upright_by_their_exif_orientation_whatever_the_backend(tmp_path, backend):
    """A camera held sideways stores its photo sideways and says so in EXIF (orientations 2-8: turns and
    mirrors): every backend decodes it upright, as a viewer shows it (DALI did; simplejpeg and Pillow kept
    it as stored, so the backends trained on different images), PNG with EXIF too. A JPEG whose editor
    said it in XMP alone is turned too (Pillow did; simplejpeg and DALI kept it as stored), one whose EXIF
    tag says 1 is not, whatever its XMP says (as Pillow reads them)."""
    rows, columns = np.mgrid[0:24, 0:40]
    stored = np.stack([rows * 10, columns * 6, (rows + columns) * 4], axis=2).astype(np.uint8)  # asymmetric
    folder = tmp_path / "001.photos"
    folder.mkdir()
    for orientation in range(1, 9):
        image = Image.fromarray(stored)
        exif = image.getexif()
        exif[0x0112] = orientation
        image.save(folder / f"{orientation}.jpg", quality=95, exif=exif.tobytes())
    image.save(folder / "8.png", exif=exif.tobytes())
    packet = '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="{}"/></x:xmpmeta>'
    for orientation in (3, 6, 7):
        image.save(folder / f"xmp{orientation}.jpg", quality=95, xmp=packet.format(orientation).encode())
    exif[0x0112] = 1
    image.save(folder / "exif1-xmp6.jpg", quality=95, exif=exif.tobytes(), xmp=packet.format(6).encode())
    batch, c = decode_all(tmp_path, backend)
    decoded = dict(zip(batch.paths, batch.data))
    for path in sorted(folder.iterdir()):
        with Image.open(path) as image:
            upright = np.asarray(ImageOps.exif_transpose(image).convert("RGB")).astype(int)
        got = decoded[str(path)]
        assert got.shape == upright.shape and np.abs(got.astype(int) - upright).mean() < 2, path.name
        assert got.flags.c_contiguous
    assert c.skipped == [] and c.converted == []


def test_dali_leaves_only_the_troublesome_files_to_the_per_file_path(bad_dataset, monkeypatch):
    """DALI fails a whole batch for one bad file: the sound colour JPEGs go to DALI, only the others are
    decoded (and named, or noted) one by one. A DALI that does not name the file (1.53 says "Unsupported
    image type" only) leaves its whole batch to the per-file path, which decodes it alike."""
    root, bad = bad_dataset
    sound = next(path for path in sorted(root.rglob("*.jpg")) if path not in bad.values())
    with pytest.raises(DaliRejected) as rejected:
        _decode_with_dali([sound.read_bytes(), bad["truncated"].read_bytes()], threads=1)
    names_it = rejected.value.sample is not None
    assert rejected.value.sample in (None, 1)
    one_by_one = []
    per_file = Decode._decode_one
    monkeypatch.setattr(Decode, "_decode_one", lambda self, data, path, c: one_by_one.append(path) or
                        per_file(self, data, path, c))
    batch, c = decode_all(root, "dali")
    assert len(batch.data) == 4 * 16 + 3 and len(c.skipped) == 4
    if names_it:
        assert set(one_by_one) <= {str(path) for path in bad.values()}, one_by_one
    else:
        assert sorted(one_by_one) == sorted(str(path) for folder in root.iterdir() if folder.is_dir()
                                            for path in folder.iterdir()), one_by_one


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "empty", "non_image"])
def test_on_error_fail_stops_naming_the_file(bad_dataset, kind):
    path = bad_dataset[1][kind]
    batch = Batch([path.read_bytes()], np.zeros(1, np.int64), [str(path)])
    with pytest.raises(BadFileError, match=rf"{path.name}: .*on_error=fail"):
        Decode()(batch, ctx(on_error="fail"))


def test_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist; set dataset.root"):
        ImageFolder(root=str(tmp_path / "nope"), batch_size=4)
    with pytest.raises(ValueError, match="no class folders"):
        ImageFolder(root=str(tmp_path), batch_size=4)


@pytest.mark.parametrize("locked", ["root", "class folder"])
def test_a_folder_this_user_cannot_list_is_an_error_naming_it_and_the_fix(tiny_dataset, open_tmp_path, locked):
    """A class folder it cannot list would be a class lost unsaid (and every label after it shifted)."""
    root = open_tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    folder = root if locked == "root" else sorted(root.iterdir())[1]
    folder.chmod(0o000)
    try:
        error = as_a_user_permissions_bind(ImageFolder, str(root), 4)
    finally:
        folder.chmod(0o755)
    assert isinstance(error, StageError), error
    refused = re.search(r"this user was refused (\S+) \(Permission denied\)", str(error))
    assert refused and refused[1].startswith(str(folder)), error  # root's: a path in it (stat refused too)
    assert "chmod -R a+rX" in str(error) and "dataset.root" in str(error)


def test_a_file_this_user_cannot_read_is_skipped_and_listed(tiny_dataset, open_tmp_path):
    root = open_tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    source = ImageFolder(root=str(root), batch_size=1000, val_per_class=0)
    locked = Path(source.files[Split.TRAIN][5][0])
    locked.chmod(0o000)

    paths, skipped = as_a_user_permissions_bind(_paths_read_and_skipped, source)
    assert skipped == [(str(locked), "cannot read: Permission denied")]
    assert len(paths) == 4 * 16 - 1 and str(locked) not in paths


def test_a_link_whose_target_is_missing_is_a_file_skipped_and_listed_saying_so(tiny_dataset, tmp_path):
    """git-annex and DVC keep a dataset's files as links into their store: one not fetched points nowhere.
    It is one of its class's files (it was left out unsaid), which a batch skips and lists saying what it
    is, or stops the run naming (on_error=fail); a link to a file is read as the file."""
    root = tmp_path / "annexed"
    shutil.copytree(tiny_dataset, root)
    first = sorted(p for p in root.iterdir() if p.is_dir())[0]
    target = tmp_path / "annex" / "objects" / "SHA256E-s1234--ab.jpg"
    (first / "not_fetched.jpg").symlink_to(target)
    (first / "fetched.jpg").symlink_to(next(first.glob("*.jpg")))
    source = ImageFolder(root=str(root), batch_size=1000, val_per_class=0)
    assert source.num_items(Split.TRAIN) == 4 * 16 + 2
    paths, skipped = _paths_read_and_skipped(source)
    assert skipped == [(str(first / "not_fetched.jpg"), f"a symbolic link to {target}, which is missing (a git-annex "
                                                         "or DVC file not fetched?)")]
    assert len(paths) == 4 * 16 + 1 and str(first / "fetched.jpg") in paths
    with pytest.raises(BadFileError, match=r"not_fetched.jpg: a symbolic link to .* \(on_error=fail"):
        source(None, ctx(on_error="fail"))
    # none fetched: the run would train on nothing, and stops before it starts, saying what the files are
    from pipeline.data.dataset import DatasetError
    from pipeline.run import _usable_sample
    from tests.test_cache import default_graph

    for path in root.rglob("*.jpg"):
        path.unlink()
        path.symlink_to(target)
    with pytest.raises(DatasetError, match=rf"^dataset.root {root}: none of the 32 files sampled across it can be "
                                           rf"used \({root}/\S+\.jpg: a symbolic link to {target}, which is missing "
                                           r"\(a git-annex or DVC file not fetched\?\); "):
        _usable_sample(default_graph(root, 0))


def _paths_read_and_skipped(source: ImageFolder):
    c = ctx()
    return source(None, c).paths, c.skipped


def test_a_dataset_that_lies_elsewhere_gives_the_same_batches(tiny_dataset, tmp_path):
    """The same files in another folder (another machine's mount, a copy): every training batch of an epoch is
    bit-identical, augmentation included, since an item's augmentation is keyed by its path inside the
    dataset. Keyed by the absolute path, as it was, runs on copies trained differently (the suite's runs,
    each on data in a folder of its own, were not reproducible)."""
    from tests.test_cache import default_graph

    copy = tmp_path / "elsewhere" / "data"
    shutil.copytree(tiny_dataset, copy)
    made = []
    for root in (tiny_dataset, copy):
        graph = default_graph(root, 0)  # no cache
        made.append([{name: (batch.data.tobytes(), batch.labels.tolist()) for name, batch in
                      graph.run(BatchContext(seed=5, split=Split.TRAIN, epoch=1, index=index)).batches.items()}
                     for index in range(graph.source.num_batches(Split.TRAIN))])
    assert len(made[0]) > 1 and made[0] == made[1]
