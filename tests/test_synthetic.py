import json
import os
import re

import numpy as np
import pytest
import simplejpeg
import torch
from omegaconf import OmegaConf
from PIL import Image

from pipeline.data import synthetic
from pipeline.data.synthetic import generate_imagefolder, read_marker, write_bad_files
from stages.base import Split
from stages.read import SPLIT_FILE, ImageFolder
from tests.conftest import as_a_user_permissions_bind, compose_config

NUM_CLASSES, IMAGES_PER_CLASS, SEED = 10, 40, 7


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic") / "caltech256"
    generate_imagefolder(root, NUM_CLASSES, IMAGES_PER_CLASS, SEED)
    return root


def class_dirs(root):
    return sorted(path for path in root.iterdir() if path.is_dir())


def test_layout_matches_caltech256(dataset):
    dirs = class_dirs(dataset)
    assert [d.name[:4] for d in dirs] == [f"{i:03d}." for i in range(1, NUM_CLASSES + 1)]
    assert all(re.fullmatch(r"\d{3}\.[a-z]+", d.name) for d in dirs)
    assert len({d.name[4:] for d in dirs}) == NUM_CLASSES
    for index, class_dir in enumerate(dirs, start=1):
        names = sorted(path.name for path in class_dir.iterdir())
        assert names == [f"{index:03d}_{i:04d}.jpg" for i in range(1, IMAGES_PER_CLASS + 1)]


def test_marker_says_synthetic_and_holds_the_parameters(dataset):
    assert "SYNTHETIC" in (dataset / synthetic.MARKER).read_text()
    marker = read_marker(dataset)
    assert marker["num_classes"] == NUM_CLASSES
    assert marker["images_per_class"] == IMAGES_PER_CLASS
    assert marker["seed"] == SEED
    assert marker["image_size"] == (300, 400)
    assert read_marker(dataset.parent) is None


def test_same_seed_gives_identical_bytes(tmp_path):
    def files(root, seed):
        generate_imagefolder(root, 3, 4, seed, image_size=(60, 80))
        return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}

    first = files(tmp_path / "a", seed=1)
    assert files(tmp_path / "b", seed=1) == first
    assert files(tmp_path / "c", seed=2) != first


def test_matching_dataset_is_kept_and_other_content_refused(tmp_path):
    root = tmp_path / "data"
    generate_imagefolder(root, 2, 2, 0, image_size=(60, 80))
    first_image = next(root.rglob("*.jpg"))
    stamp = first_image.stat().st_mtime_ns
    generate_imagefolder(root, 2, 2, 0, image_size=(60, 80))
    assert first_image.stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="not the synthetic dataset"):
        generate_imagefolder(root, 2, 3, 0, image_size=(60, 80))


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "_render_image", crash)
    with pytest.raises(KeyboardInterrupt):
        generate_imagefolder(tmp_path / "data", 2, 2, 0, image_size=(60, 80))
    assert list(tmp_path.iterdir()) == []


def test_concurrent_generation_of_the_same_dataset_succeeds(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_classes = synthetic._write_classes

    def other_run_finishes_first(*args):
        monkeypatch.setattr(synthetic, "_write_classes", write_classes)
        generate_imagefolder(root, 2, 2, 0, image_size=(60, 80))
        write_classes(*args)

    monkeypatch.setattr(synthetic, "_write_classes", other_run_finishes_first)
    generate_imagefolder(root, 2, 2, 0, image_size=(60, 80))
    assert read_marker(root)["num_classes"] == 2
    assert list(tmp_path.iterdir()) == [root]


def test_generates_into_an_existing_empty_folder(tmp_path):
    (tmp_path / "data").mkdir()
    generate_imagefolder(tmp_path / "data", 2, 2, 0, image_size=(60, 80))
    assert read_marker(tmp_path / "data")["num_classes"] == 2


def test_images_are_photo_sized_and_textured(dataset):
    files = sorted(dataset.rglob("*.jpg"))
    bits_per_pixel = []
    for path in files:
        data = path.read_bytes()
        assert simplejpeg.decode_jpeg_header(data)[:2] == (300, 400)
        bits_per_pixel.append(len(data) * 8 / (300 * 400))
    # Decode time grows with the entropy-coded size. At quality 90 and this size,
    # photos take 2.5-4 bits/px and a flat colour 0.2: each image must be far
    # from flat, and on average near photos.
    assert min(bits_per_pixel) > 1.5
    assert np.mean(bits_per_pixel) > 2.5
    assert min(simplejpeg.decode_jpeg(path.read_bytes()).std() for path in files[::10]) > 15


def test_bad_files_are_what_they_claim(tmp_path):
    class_dir = tmp_path / "001.kavoti"
    class_dir.mkdir()
    bad = write_bad_files(class_dir)
    assert set(bad) == {
        "corrupt", "truncated", "empty", "non_image", "grayscale", "cmyk", "png_named_jpg"
    }
    for path in bad.values():
        assert path.parent == class_dir
        assert re.fullmatch(r"001_9\d{3}\.jpg", path.name)

    for kind in ("corrupt", "truncated", "non_image", "empty"):
        with pytest.raises(ValueError):
            simplejpeg.decode_jpeg(bad[kind].read_bytes())
    assert bad["corrupt"].read_bytes()[:3] == b"\xff\xd8\xff"
    assert bad["empty"].stat().st_size == 0
    assert Image.open(bad["grayscale"]).mode == "L"
    assert Image.open(bad["cmyk"]).mode == "CMYK"
    assert bad["png_named_jpg"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(bad["png_named_jpg"]).format == "PNG"


def random_resized_crops(images, size, rng):
    """torchvision-style random resized crop (8-100% area, 3/4-4/3 aspect) + flip, nearest."""
    height, width = images.shape[1:3]
    crops = np.empty((len(images), size, size, 3), np.uint8)
    for i, image in enumerate(images):
        area = height * width * rng.uniform(0.08, 1.0)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        h = min(height, round(np.sqrt(area / aspect)))
        w = min(width, round(np.sqrt(area * aspect)))
        top, left = rng.integers(height - h + 1), rng.integers(width - w + 1)
        rows = top + (np.arange(size) * h) // size
        cols = left + (np.arange(size) * w) // size
        crops[i] = image[rows[:, None], cols[None, :]]
        if rng.random() < 0.5:
            crops[i] = crops[i, :, ::-1]
    return crops


def tiny_cnn(num_classes):
    def block(cin, cout):
        return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]

    return torch.nn.Sequential(
        *block(3, 16), *block(16, 32), *block(32, 32),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, num_classes),
    )


def as_tensor(batch):
    return torch.from_numpy(batch).permute(0, 3, 1, 2).float() / 255


@pytest.fixture
def one_torch_thread():
    # A tiny model gains nothing from threads, and they crawl on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_classes_are_learnable_from_small_random_crops(dataset, one_torch_thread):
    # DCT-scaled decoding to ~1/4 size (75x100) stands in for the pipeline's resize.
    images, labels = [], []
    for label, class_dir in enumerate(class_dirs(dataset)):
        for path in sorted(class_dir.glob("*.jpg")):
            images.append(simplejpeg.decode_jpeg(path.read_bytes(), min_height=64, min_width=64))
            labels.append(label)
    images, labels = np.stack(images), torch.tensor(labels)
    held_out = np.arange(len(images)) % 4 == 0

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = tiny_cnn(NUM_CLASSES)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    train_images, train_labels = images[~held_out], labels[~held_out]
    for _ in range(10):
        crops = as_tensor(random_resized_crops(train_images, 32, rng))
        for batch in torch.randperm(len(crops)).split(32):
            loss = torch.nn.functional.cross_entropy(model(crops[batch]), train_labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    with torch.no_grad():
        crops = as_tensor(random_resized_crops(images[held_out], 32, rng))
        accuracy = (model(crops).argmax(1) == labels[held_out]).float().mean().item()
    # Seeds 7-9 give 0.75-0.89; chance is 0.1.
    assert accuracy > 3 / NUM_CLASSES, f"held-out accuracy {accuracy:.2f}"


def test_difficulty_blends_the_classes_and_is_recorded(tmp_path):
    """Harder stand-ins are harder to classify: a nearest-centroid classifier on each image's mean
    colour and colour spread (leave-one-out) tells the easy classes apart far better than the hard."""
    def accuracy(difficulty):
        root = tmp_path / f"difficulty-{difficulty}"
        generate_imagefolder(root, 6, 24, 0, image_size=(60, 80), difficulty=difficulty)
        assert read_marker(root)["difficulty"] == difficulty
        features, labels = [], []
        for label, class_dir in enumerate(class_dirs(root)):
            for path in sorted(class_dir.iterdir()):
                pixels = simplejpeg.decode_jpeg(path.read_bytes()).reshape(-1, 3).astype(np.float64)
                features.append(np.concatenate([pixels.mean(0), pixels.std(0)]))
                labels.append(label)
        features, labels = np.array(features), np.array(labels)
        right = 0
        for i in range(len(labels)):
            others = np.arange(len(labels)) != i
            centroids = [features[others & (labels == c)].mean(0) for c in range(6)]
            right += np.argmin([np.linalg.norm(features[i] - c) for c in centroids]) == labels[i]
        return right / len(labels)

    easy, hard = accuracy(0.0), accuracy(1.0)
    assert easy > 0.6 and hard < easy - 0.15, (easy, hard)  # (chance: 1/6; measured 0.80 and 0.56)
    with pytest.raises(ValueError, match=r"difficulty must be in \[0, 1\], got 1.5"):
        generate_imagefolder(tmp_path / "bad", 2, 2, 0, image_size=(60, 80), difficulty=1.5)


def test_the_stand_in_declares_its_split_and_a_new_split_regenerates_it(tmp_path):
    root = tmp_path / "data"
    generate_imagefolder(root, 2, 13, 0, image_size=(60, 80))
    # The default split (30 of the default ensemble's 129 images a class): the next test.
    assert json.loads((root / SPLIT_FILE).read_text()) == {"val_per_class": 0.23}
    assert read_marker(root)["val_per_class"] == 0.23
    source = ImageFolder(root=str(root), batch_size=8)
    assert (source.num_items(Split.TRAIN), source.num_items(Split.VAL)) == (2 * 10, 2 * 3)  # round(13 * 0.23)

    # The marker holds the split: another split is another dataset (prepare_dataset makes it again).
    with pytest.raises(FileExistsError, match="not the synthetic dataset"):
        generate_imagefolder(root, 2, 13, 0, image_size=(60, 80), val_per_class=None)
    plain = tmp_path / "plain"
    generate_imagefolder(plain, 2, 13, 0, image_size=(60, 80), val_per_class=None)
    assert not (plain / SPLIT_FILE).exists() and read_marker(plain)["val_per_class"] is None
    assert ImageFolder(root=str(plain), batch_size=8).num_items(Split.VAL) == 2 * 1  # round(13 * 0.1)
    with pytest.raises(ValueError, match="val_per_class must be >= 0 or None, got -1"):
        generate_imagefolder(tmp_path / "bad", 2, 2, 0, image_size=(60, 80), val_per_class=-1)


def test_the_default_ensembles_stand_in_validates_on_30_images_a_class_and_a_given_root_on_10_percent(
        tmp_path):
    """The split is the stand-in's alone: the same config on a dataset the user gives keeps 10%."""
    from pipeline.data.dataset import Synthetic, prepare_dataset

    cfg = compose_config(["+ensemble=caltech256", f"dataset.root={tmp_path / 'c256'}"])
    assert cfg.dataset.val_per_class is None and cfg.dataset.synthetic_images_per_class == 129
    stages = OmegaConf.to_container(cfg.pipeline.stages, resolve=True)
    assert stages["read"]["val_per_class"] is None

    # A tree the user gives (no marker, no split.json), 129 images a class: 13 validation images a class.
    given = tmp_path / "given"
    generate_imagefolder(given, 2, 129, 0, image_size=(24, 32), val_per_class=None)
    (given / synthetic.MARKER).unlink()
    info = prepare_dataset(str(given), Synthetic.auto, 2, 129, 0.0)
    assert (info.root, info.synthetic) == (given, False)
    read = ImageFolder(root=str(given), batch_size=64, val_per_class=stages["read"]["val_per_class"])
    assert (read.num_items(Split.TRAIN), read.num_items(Split.VAL)) == (2 * 116, 2 * 13)

    # The stand-in the run makes at an empty root (its call, as pipeline/run.py makes it): 30 a class.
    made = tmp_path / "made"
    assert prepare_dataset(str(made), Synthetic.auto, 2, 129, 0.0).synthetic
    read = ImageFolder(root=str(made), batch_size=64, val_per_class=stages["read"]["val_per_class"])
    assert (read.num_items(Split.TRAIN), read.num_items(Split.VAL)) == (2 * 99, 2 * 30)


def test_the_stand_in_has_the_umasks_permissions_so_other_users_can_read_it(tmp_path):
    umask = os.umask(0o022)  # the usual one (under 0o077, the default of some, 0700 would be right)
    try:
        root = tmp_path / "made"
        generate_imagefolder(root, 2, 4, 0, image_size=(24, 32))
    finally:
        os.umask(umask)
    for path in [root, *root.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


def test_a_root_this_user_cannot_read_or_generate_in_is_an_error_naming_the_key_and_the_fix(open_tmp_path):
    from pipeline.data.dataset import DatasetError, Synthetic, prepare_dataset

    unreadable = open_tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "001.class").mkdir()
    unreadable.chmod(0o000)
    error = as_a_user_permissions_bind(prepare_dataset, str(unreadable), Synthetic.auto, 2, 4, 0.0)
    assert isinstance(error, DatasetError), error
    assert f"dataset.root {unreadable} cannot be read by this user (Permission denied" in str(error)
    assert "chmod -R a+rX" in str(error)

    read_only = open_tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    error = as_a_user_permissions_bind(prepare_dataset, str(read_only / "c256"), Synthetic.auto, 2, 4, 0.0)
    assert isinstance(error, DatasetError), error
    assert (f"dataset.root {read_only / 'c256'} holds no dataset, and the synthetic stand-in cannot be written "
            "there (Permission denied") in str(error)
    assert not any(read_only.iterdir())
    unreadable.chmod(0o755)


def test_a_stand_in_a_run_trains_on_is_not_made_anew_under_it(tmp_path):
    """The runs of a parallel sweep over dataset.synthetic_* start together at one root: the second made its
    stand-in (other parameters) over the first's files as the first trained (seen under the joblib launcher:
    a traceback, or the first run's files deleted). While a run holds the stand-in, another is refused,
    naming the fix; runs of the same stand-in share it, and so does a run that only reads it
    (dataset.synthetic=never: it held nothing before); once none holds it, it is made anew."""
    from pipeline.data.dataset import DatasetError, Synthetic, prepare_dataset

    root = tmp_path / "stand_in"
    first = prepare_dataset(str(root), Synthetic.auto, 2, 4, 0.0)
    files = {path: path.read_bytes() for path in root.rglob("*.jpg")}
    refused = (r"holds the synthetic stand-in made with other parameters, and another run trains on it.*"
               r"'dataset.root=data/stand_in_\$\{dataset.synthetic_difficulty\}'")
    with pytest.raises(DatasetError, match=refused):
        prepare_dataset(str(root), Synthetic.auto, 2, 4, 1.0)
    assert {path: path.read_bytes() for path in root.rglob("*.jpg")} == files
    same = prepare_dataset(str(root), Synthetic.auto, 2, 4, 0.0)
    assert same.synthetic and not same.generated_now
    first.release()
    with pytest.raises(DatasetError, match=refused):  # `same` holds it still
        prepare_dataset(str(root), Synthetic.auto, 2, 4, 1.0)
    same.release()
    reader = prepare_dataset(str(root), Synthetic.never, 2, 4, 0.0)
    assert reader.synthetic and not reader.generated_now
    with pytest.raises(DatasetError, match=refused):
        prepare_dataset(str(root), Synthetic.auto, 2, 4, 1.0)
    assert {path: path.read_bytes() for path in root.rglob("*.jpg")} == files
    reader.release()
    second = prepare_dataset(str(root), Synthetic.auto, 2, 4, 1.0)
    assert second.generated_now and read_marker(root)["difficulty"] == 1.0
    second.release()


def test_the_runs_seed_leaves_the_stand_in_as_it_is(tmp_path):
    """seed=0 and seed=1 (a sweep over seeds, in parallel here: the first run still holds the stand-in):
    one stand-in for both, as its dataset.synthetic_* values make it; the seed fixes shuffles,
    augmentations and initial weights. The run's seed made the stand-in anew (other class names, other
    images), and a parallel sweep over seeds failed on the one in use."""
    from pipeline.run import prepare_inputs

    cfgs = [compose_config(["+ensemble=caltech256", f"dataset.root={tmp_path / 'd'}", "dataset.synthetic_classes=2",
                            "dataset.synthetic_images_per_class=6", f"seed={seed}"]) for seed in (0, 1)]
    first = prepare_inputs(cfgs[0])
    try:
        second = prepare_inputs(cfgs[1])
        second.dataset.release()
    finally:
        first.dataset.release()
    assert first.dataset.generated_now and not second.dataset.generated_now
    assert first.graph.source.files == second.graph.source.files
