"""A synthetic stand-in for Caltech256: learnable, photo-like JPEGs in its folder layout.

Each class has a two-colour palette and a stripe texture (orientation, period);
each image shows that texture on a soft blob of random position and size over
a neutral background, with random phase, scale, brightness and colour cast.
Natural-image-like 1/f noise (wavy, frayed stripes, textured background, uneven
lighting) makes the JPEGs cost about as much to decode as photos of that size.

`difficulty` (0 to 1) makes the classes harder to tell apart: each image's
texture is blended with a random other class's, by a random share up to a
tenth at difficulty 1, and orientation and colour vary more within a class.
At 0 the images are the easy ones every model learns in two epochs (the
tests' datasets).

The stand-in declares its own validation split, `VAL_PER_CLASS` of each class,
in `split.json` (stages.read.SPLIT_FILE): the read stage uses it unless
dataset.val_per_class is set, so a dataset given by the user keeps its 10%.
"""

from __future__ import annotations

import colorsys
import io
import json
import math
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from stages.read import SPLIT_FILE

MARKER = "SYNTHETIC.txt"
GENERATOR_VERSION = 1  # bump when the images change, so old datasets stop matching
JPEG_QUALITY = 90
# Amplitudes of the 1/f noise, tuned so the JPEGs take ~3.2 bits/px as photos do.
NOISE_FIELDS = 4
WARP = 0.5  # radians of stripe phase per unit of noise: wavy, frayed stripes
BACKGROUND_TEXTURE = 15.0  # grey levels per unit of noise
LIGHTING_VARIATION = 0.1  # relative brightness per unit of noise
# The default ensemble (10 classes, 8 epochs) ends near 45% at difficulty 1 and near 75% at 0.5; at 0 it
# reaches 100% in two epochs: small blends already take the easy cues away.
MAX_BLEND = 0.1  # at difficulty 1: the largest share of another class's texture in an image
ANGLE_JITTER = (0.08, 0.125)  # radians (std) of an image's stripe angle about its class's: at difficulty 0, 1
CAST_JITTER = (0.1, 0.13)  # relative colour cast of an image, at difficulty 0 and 1
# The stand-in's validation split: 30 of each class's 129 images in the default ensemble. With 10% (11
# images a class) one image was 0.9% of the validation set and the ensemble never beat its best member;
# with 30 it does (docs/scheduler.md, "The default stand-in").
VAL_PER_CLASS = 0.23


@dataclass(frozen=True)
class _ClassStyle:
    name: str
    palette: np.ndarray  # (2, 3) RGB in 0..255: stripe troughs, stripe crests
    angle: float  # radians in [0, pi/2]: a flip maps a to -a, so wider ranges would collide
    period: float  # stripe period as a fraction of the image width


def generate_imagefolder(
    root: Path,
    num_classes: int,
    images_per_class: int,
    seed: int,
    image_size: tuple[int, int] = (300, 400),
    difficulty: float = 0.0,
    val_per_class: float | None = VAL_PER_CLASS,
) -> None:
    """Write `root/001.<name>/001_0001.jpg`, ..., the `SYNTHETIC.txt` marker and,
    unless `val_per_class` is None, the split the dataset declares (`split.json`).

    `image_size` is (height, width); `difficulty` in [0, 1] (module docstring);
    `val_per_class` as the read stage's: a fraction if < 1, else a count.
    Returns at once if `root` already holds this exact dataset; refuses to touch
    any other non-empty `root`.
    """
    if not 0 <= difficulty <= 1:
        raise ValueError(f"difficulty must be in [0, 1], got {difficulty}")
    if val_per_class is not None and val_per_class < 0:
        raise ValueError(f"val_per_class must be >= 0 or None, got {val_per_class}")
    root = Path(root)
    params = _marker_params(num_classes, images_per_class, seed, image_size, difficulty, val_per_class)
    if read_marker(root) == params:
        return
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(
            f"{root} exists and is not the synthetic dataset {params}; "
            "remove it or choose another root"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    # Build in a hidden sibling and rename it at the end: an interrupted run
    # never leaves a `root` that looks complete. Made by mkdir, not mkdtemp, so that
    # the dataset gets the umask's permissions as its files do (mkdtemp's 0700 would
    # keep it from every other user).
    staging = root.parent / f".{root.name}.partial-{secrets.token_hex(8)}"
    staging.mkdir()
    try:
        _write_classes(staging, num_classes, images_per_class, seed, image_size, difficulty)
        if val_per_class is not None:
            (staging / SPLIT_FILE).write_text(json.dumps({"val_per_class": val_per_class}) + "\n")
        (staging / MARKER).write_text(_marker_text(params))
        staging.rename(root)  # replaces `root` only if it is an empty directory
    except OSError:
        if read_marker(root) != params:
            raise
        # Else a concurrent run (e.g. a parallel sweep job) made the same dataset first.
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_marker(root: Path) -> dict | None:
    """The generation parameters of a complete synthetic dataset at `root`, else None."""
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    params = json.loads(marker.read_text().splitlines()[-1])
    params["image_size"] = tuple(params["image_size"])
    params.setdefault("difficulty", 0.0)  # written before it was a parameter: the easy images
    return params


def write_bad_files(class_dir: Path) -> dict[str, Path]:
    """Write one troublesome file of each kind into `class_dir`; return kind -> path."""
    class_dir = Path(class_dir)
    image = _small_test_image()
    jpeg = _encode(image, "JPEG")
    soi_and_app0 = jpeg[:20]  # a real JFIF header, so the file is sniffed as JPEG
    contents = {
        "corrupt": soi_and_app0 + np.random.default_rng(0).bytes(4096),
        "truncated": jpeg[: len(jpeg) // 2],
        "empty": b"",
        "non_image": b"This is a text file with a .jpg name, not an image.\n",
        "grayscale": _encode(image.convert("L"), "JPEG"),
        "cmyk": _encode(image.convert("CMYK"), "JPEG"),
        "png_named_jpg": _encode(image, "PNG"),
    }
    class_idx = class_dir.name.split(".")[0]
    paths = {}
    for number, (kind, data) in enumerate(contents.items(), start=9001):
        paths[kind] = class_dir / f"{class_idx}_{number:04d}.jpg"
        paths[kind].write_bytes(data)
    return paths


def _class_styles(num_classes: int, seed: int) -> list[_ClassStyle]:
    """The name, palette and texture of each class, fixed by `seed`."""
    rng = np.random.default_rng([seed, 0])
    first_hue = rng.random()
    names = _class_names(num_classes, rng)
    styles = []
    for index, name in enumerate(names):
        hue = (first_hue + index * 0.618034) % 1.0  # golden-ratio steps spread hues evenly
        trough = colorsys.hsv_to_rgb(hue, rng.uniform(0.5, 1.0), rng.uniform(0.25, 0.55))
        crest_hue = (hue + rng.uniform(0.15, 0.5)) % 1.0
        crest = colorsys.hsv_to_rgb(crest_hue, rng.uniform(0.4, 0.9), rng.uniform(0.65, 1.0))
        styles.append(
            _ClassStyle(
                name=name,
                palette=np.array([trough, crest], dtype=np.float32) * 255,
                angle=rng.uniform(0, np.pi / 2),
                period=rng.uniform(0.035, 0.12),
            )
        )
    return styles


def _write_classes(root, num_classes, images_per_class, seed, image_size, difficulty):
    noise = _pink_noise_fields(np.random.default_rng([seed, 1]), image_size)
    styles = _class_styles(num_classes, seed)
    jobs = []
    for class_idx, style in enumerate(styles, start=1):
        class_dir = root / f"{class_idx:03d}.{style.name}"
        class_dir.mkdir()
        for image_idx in range(1, images_per_class + 1):
            path = class_dir / f"{class_idx:03d}_{image_idx:04d}.jpg"
            # One generator per image: the bytes do not depend on thread scheduling.
            rng = np.random.default_rng([seed, 2, class_idx, image_idx])
            if difficulty and num_classes > 1:  # (no draw at 0: the easy images stay as they were)
                other = styles[(class_idx - 1 + rng.integers(1, num_classes)) % num_classes]
                style = _blend(style, other, difficulty * rng.uniform(0, MAX_BLEND))
            jobs.append((path, style, rng))

    def write(path, style, rng):
        _render_image(style, noise, rng, image_size, difficulty).save(path, quality=JPEG_QUALITY)

    # Threads suffice: numpy and Pillow's encoder release the GIL.
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for done in [pool.submit(write, *job) for job in jobs]:
            done.result()


def _blend(style, other, share):
    """`style` with `share` of `other`'s palette, angle and period."""
    mix = lambda a, b: (1 - share) * a + share * b
    return _ClassStyle(style.name, mix(style.palette, other.palette).astype(np.float32),
                       mix(style.angle, other.angle), mix(style.period, other.period))


def _render_image(style, noise, rng, image_size, difficulty):
    """One RGB image of the class `style`."""
    # Channels first (numpy broadcasts much faster over rows than over a last axis
    # of 3) and Python-float parameters (numpy scalars would promote to float64).
    height, width = image_size
    y = np.arange(height, dtype=np.float32)[:, None]
    x = np.arange(width, dtype=np.float32)[None, :]
    warp = _window(rng, noise[rng.integers(NOISE_FIELDS)], image_size)
    shade = _window(rng, noise[rng.integers(NOISE_FIELDS)], image_size)

    angle = style.angle + rng.normal(0, _between(ANGLE_JITTER, difficulty))
    k = 2 * math.pi / (style.period * width * rng.uniform(0.8, 1.25))
    phase = (k * math.cos(angle)) * x + (k * math.sin(angle)) * y + rng.uniform(0, 2 * math.pi)
    stripes = 0.5 + 0.5 * np.cos(phase + WARP * warp)
    cast = _between(CAST_JITTER, difficulty)
    palette = (style.palette * rng.uniform(1 - cast, 1 + cast, size=3)).astype(np.float32)  # colour cast
    trough, crest = palette[:, :, None, None]
    texture = trough + (crest - trough) * stripes

    background = rng.uniform(90, 170) + BACKGROUND_TEXTURE * warp
    blob = _soft_ellipse(rng, y / height, x / width)
    lighting = rng.uniform(0.7, 1.15) * (1 + LIGHTING_VARIATION * shade)
    pixels = (background + blob * (texture - background)) * lighting
    channels = np.clip(pixels, 0, 255).astype(np.uint8)
    return Image.merge("RGB", [Image.fromarray(channel) for channel in channels])


def _between(ends: tuple[float, float], difficulty: float) -> float:
    return ends[0] + (ends[1] - ends[0]) * difficulty


def _soft_ellipse(rng, y, x):
    """1 inside an ellipse covering most of the image, 0 outside, a soft edge between."""
    cy, cx, ry, rx = rng.uniform(0.35, 0.65, size=4).tolist()
    distance = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2
    return np.clip((1.2 - distance) * 4, 0, 1)


def _pink_noise_fields(rng, image_size):
    """Fields twice the image size, amplitude ~ 1/frequency as in natural images, std 1.

    Made once per dataset: images read random windows (fresh noise per image is slow).
    """
    shape = (NOISE_FIELDS, 2 * image_size[0], 2 * image_size[1])
    fy = np.fft.fftfreq(shape[1])[:, None]
    fx = np.fft.rfftfreq(shape[2])[None, :]
    frequency = np.hypot(fy, fx)
    frequency[0, 0] = np.inf  # no DC: zero mean
    spectrum_shape = (NOISE_FIELDS, *frequency.shape)
    spectrum = rng.standard_normal(spectrum_shape) + 1j * rng.standard_normal(spectrum_shape)
    fields = np.fft.irfft2(spectrum / frequency, s=shape[1:])
    fields /= fields.std(axis=(1, 2), keepdims=True)
    return fields.astype(np.float32)


def _window(rng, field, image_size):
    """A random image-sized window of a larger noise field."""
    top = rng.integers(field.shape[0] - image_size[0] + 1)
    left = rng.integers(field.shape[1] - image_size[1] + 1)
    return field[top : top + image_size[0], left : left + image_size[1]]


def _class_names(count, rng):
    """Distinct pronounceable made-up names, like 'kavoti'."""
    consonants, vowels = list("bdfgklmnprstvz"), list("aeiou")
    names: list[str] = []
    while len(names) < count:
        syllables = rng.integers(2, 4)
        name = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables))
        if name not in names:
            names.append(name)
    return names


def _marker_params(num_classes, images_per_class, seed, image_size, difficulty, val_per_class):
    # A marker written before val_per_class was a parameter lacks it: that stand-in differs, and is made again.
    return {
        "generator": "pipeline.data.synthetic",
        "version": GENERATOR_VERSION,
        "num_classes": num_classes,
        "images_per_class": images_per_class,
        "seed": seed,
        "image_size": tuple(image_size),
        "difficulty": difficulty,
        "val_per_class": val_per_class,
    }


def _marker_text(params):
    return (
        "SYNTHETIC DATASET: a generated stand-in for Caltech256, not real photographs.\n"
        "Made by pipeline.data.synthetic.generate_imagefolder; accuracies measured on it say\n"
        "nothing about Caltech256. Generation parameters (JSON, last line):\n"
        f"{json.dumps(params)}\n"
    )


def _small_test_image():
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:96, 0:128]
    gradient = np.stack([x * 2, y * 2, x + y], axis=-1).astype(np.float32)
    pixels = gradient + rng.normal(0, 12, gradient.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _encode(image, format):
    buffer = io.BytesIO()
    image.save(buffer, format=format, quality=JPEG_QUALITY)
    return buffer.getvalue()
