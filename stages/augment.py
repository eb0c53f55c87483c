"""Augment stage: random resized crop + horizontal flip for training, center
crop for validation; variable-size images in, one uint8 NHWC tensor out.
Resizing is OpenCV's, on numpy views (no conversions), the way Pillow's
`reducing_gap` works: a shrink by 2x or more first averages k x k blocks
(antialiased, and fast for a whole factor k), then bilinear interpolation does
the remaining factor, under 2x."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

import cv2
import numpy as np

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Split, Stage, StageError

cv2.setNumThreads(1)  # parallelism comes from the Dask workers; more threads only contend


@dataclass
class RandomResizedCropFlip(Stage):
    """Inception-style crop (area fraction `scale`, aspect `ratio`) resized to
    `size`, flipped with probability `flip`; validation resizes the shorter
    side to size / crop_fraction and takes the center."""

    size: int  # output height and width in pixels
    scale: tuple[float, float] = (0.08, 1.0)  # range of the crop's area as a fraction of the image
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # range of the crop's aspect ratio (width / height)
    flip: float = 0.5  # probability of a horizontal flip (training only)
    crop_fraction: float = 0.875  # validation: center crop side / resized shorter side

    role: ClassVar[Role] = Role.MAP
    accepts: ClassVar[DataKind | None] = DataKind.IMAGES

    def __post_init__(self) -> None:
        self.scale, self.ratio = tuple(self.scale), tuple(self.ratio)
        if self.size < 1:
            raise StageError(f"size must be >= 1 pixel, got {self.size}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise StageError(f"scale must be (min, max) with 0 < min <= max <= 1, got {list(self.scale)}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise StageError(f"ratio must be (min, max) with 0 < min <= max, got {list(self.ratio)}")
        if not 0 <= self.flip <= 1:
            raise StageError(f"flip is a probability in [0, 1], got {self.flip}")
        if not 0 < self.crop_fraction <= 1:
            raise StageError(f"crop_fraction must be in (0, 1], got {self.crop_fraction}")

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return Spec(DataKind.TENSOR, (self.size, self.size, 3))

    def min_input_side(self) -> int | None:
        # The smallest training crop spans about sqrt(min area) of the shorter side.
        return math.ceil(max(self.size / math.sqrt(self.scale[0]), self.size / self.crop_fraction))

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        assert batch is not None
        out = np.empty((len(batch.data), self.size, self.size, 3), dtype=np.uint8)
        for i, (image, path) in enumerate(zip(batch.data, batch.paths)):
            height, width = image.shape[:2]
            if ctx.split is Split.TRAIN:
                rng = ctx.item_rng(path)
                box = self._random_box(rng, height, width)
                flip = rng.random() < self.flip
            else:
                box, flip = self._center_box(height, width), False
            x0, y0, x1, y1 = box
            self._resize(image[y0:y1, x0:x1], dst=out[i])
            if flip:  # in place, while the image is in cache
                cv2.flip(out[i], 1, dst=out[i])
        return Batch(out, batch.labels, batch.paths)

    def _resize(self, crop: np.ndarray, dst: np.ndarray) -> np.ndarray:
        height, width = crop.shape[:2]
        block = min(height, width) // self.size
        if block >= 2:  # whole blocks only: the edge loses under `block` pixels
            crop = cv2.resize(crop[:height - height % block, :width - width % block],
                              (width // block, height // block), interpolation=cv2.INTER_AREA)
        return cv2.resize(crop, (self.size, self.size), dst=dst, interpolation=cv2.INTER_LINEAR)

    def _random_box(self, rng: random.Random, height: int, width: int) -> tuple[int, int, int, int]:
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                x, y = rng.randint(0, width - w), rng.randint(0, height - h)
                return x, y, x + w, y + h
        # Rare (extreme aspect ratios): the largest crop within `ratio`, centred.
        aspect = min(max(width / height, self.ratio[0]), self.ratio[1])
        w, h = (width, round(width / aspect)) if width / height < aspect else (round(height * aspect), height)
        x, y = (width - w) // 2, (height - h) // 2
        return x, y, x + w, y + h

    def _center_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        side = max(1, round(min(height, width) * self.crop_fraction))
        x, y = (width - side) // 2, (height - side) // 2
        return x, y, x + side, y + side
