"""Benchmark of region-of-interest (ROI) JPEG decoding against today's decode-then-crop path.

At small output sizes DALI's `decoders.image_random_crop` wins by decoding
only the crop window. This measures, on the project's own stages, whether a
ROI decode pays on our CPU path, per core (one process, no worker pool):

  (a) today: `stages.decode.Decode` (simplejpeg) at the DCT scale it chooses
      for the augment stage's need, then the crop and resize of
      `RandomResizedCropFlip` (its `_resize`: block average, then bilinear);
      beside it, as a control, the same at full size ("full decode, crop");
  (b) each ROI decoder found installed, decoding only the crop window, then
      the same `_resize` to the output size:
      - nvimgcodec: nvImageCodec's CPU libjpeg-turbo decoder (installed with
        DALI), ROI through `CodeStream.get_sub_code_stream(region=...)`:
        jpeg_crop_scanline + jpeg_skip_scanlines, no DCT scaling;
      - DALI slice: DALI's CPU `decoders.image_slice` (device_id=None, one
        thread) with per-sample windows from external_source: the same
        nvImageCodec decoder behind DALI's executor;
      - turbojpeg crop+scale: PyTurboJPEG 1.x (pip install 'PyTurboJPEG<2';
        it loads Debian's libturbojpeg0, libjpeg-turbo 2.1): a lossless crop
        to the iMCU-aligned window (`crop_multiple`, tjTransform), then a
        decode of that at the largest DCT reduction that keeps the crop's
        shorter side >= the output size.
  Two bounds, not paths, bracket a one-pass window decode at a DCT scale,
  which no binding offers (see `ScaledWindowBound`).

Every contender gets the same crop box per file: drawn by the real stage,
`RandomResizedCropFlip(size, scale=SCALE)._random_box`, on the full-size
header dimensions with a `random.Random` keyed by the file (for (a) the box is
mapped onto the DCT-reduced image, as the stage would draw it there). The
flip is left out (the same for all). Files are read into memory first; the
header parse each ROI contender needs to draw its box is inside its timing.
Rates are images per CPU-second of this process (all its threads), the
median of `--rounds` rounds in rotation; outputs are checked for shape and
their mean absolute difference from (a) and from the full-size control. A
contender whose package or library is missing is listed as skipped.

    python scripts/bench_roi_decode.py                      # 300 synthetic JPEGs in a temp dir
    python scripts/bench_roi_decode.py --images DIR --json bench_results/roi_decode.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import cv2
import numpy as np
import simplejpeg

from stages.augment import RandomResizedCropFlip
from stages.base import Batch, BatchContext, Split
from stages.decode import Decode

SCALE = (0.25, 1.0)  # area fraction of the random crop, as in pipeline/conf/pipeline/two_branches.yaml
BATCH_SIZE = 64  # images per stage call, as the pipeline's batches
DCT_SCALES = [Fraction(n, 8) for n in range(1, 9)]  # libjpeg-turbo's reductions a decoder may pick, smallest first


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, help="a folder of JPEGs (searched recursively); default: synthetic")
    parser.add_argument("--count", type=int, default=300, help="synthetic JPEGs to make when --images is not given")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224], help="output sizes, one table each")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, contenders in rotation")
    parser.add_argument("--passes", type=int, default=2, help="passes over the files in one timed round")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


# --- Data -------------------------------------------------------------------------

def make_jpegs(folder: Path, count: int, seed: int = 0) -> None:
    """`count` textured JPEGs of 250-500 px a side: smooth colour gradients, blobs of
    coarse noise and some fine grain, 4:2:0 at quality 90 (as most photographs)."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        height, width = (int(v) for v in rng.integers(250, 501, size=2))
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        gradient = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * rng.uniform(60, 160, 3)
        coarse = cv2.resize(rng.normal(0, 40, (height // 16 + 1, width // 16 + 1, 3)).astype(np.float32),
                            (width, height), interpolation=cv2.INTER_CUBIC)
        grain = rng.normal(0, 12, (height, width, 3))
        image = np.clip(gradient + coarse + grain + 40, 0, 255).astype(np.uint8)
        (folder / f"{i:05d}.jpg").write_bytes(simplejpeg.encode_jpeg(image, quality=90, colorsubsampling="420"))


def load_files(folder: Path) -> list[tuple[str, bytes, int, int]]:
    """(path, bytes, height, width) of every colour or grey JPEG under `folder`."""
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg")):
        data = path.read_bytes()
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            continue
        if colorspace in ("YCbCr", "Gray"):
            files.append((str(path), data, height, width))
    return files


def draw_boxes(augment: RandomResizedCropFlip, files: list) -> list[tuple[int, int, int, int]]:
    """The stage's crop box (x0, y0, x1, y1) on each file's full-size dimensions."""
    return [augment._random_box(random.Random(f"roi/{path}"), height, width) for path, _, height, width in files]


# --- Contenders ---------------------------------------------------------------------

class Today:
    """(a) The Decode stage at its DCT scale for the augment stage's need, then crop + resize."""

    name = "today: decode, crop"

    def __init__(self, augment: RandomResizedCropFlip):
        self.augment = augment
        self.decode = Decode(backend="simplejpeg")
        self.decode.set_consumer_need(augment.min_input_side())
        self.decoded_pixels = 0  # of the last run, for the table

    def run(self, files: list, boxes: list, out: np.ndarray) -> None:
        self.decoded_pixels = 0
        for start in range(0, len(files), BATCH_SIZE):
            chunk = files[start:start + BATCH_SIZE]
            ctx = BatchContext(seed=0, split=Split.TRAIN, epoch=0, index=start // BATCH_SIZE)
            batch = self.decode(Batch([data for _, data, _, _ in chunk], np.zeros(len(chunk), np.int64),
                                      [path for path, _, _, _ in chunk]), ctx)
            for i, (image, (_, _, height, width)) in enumerate(zip(batch.data, chunk), start):
                # The box drawn on the full size, onto the reduced image (the stage draws it there).
                x0, y0, x1, y1 = boxes[i]
                h, w = image.shape[:2]
                sx, sy = w / width, h / height
                crop = image[round(y0 * sy):max(round(y1 * sy), round(y0 * sy) + 1),
                             round(x0 * sx):max(round(x1 * sx), round(x0 * sx) + 1)]
                self.augment._resize(crop, dst=out[i])
                self.decoded_pixels += h * w


class FullDecode(Today):
    """Control: the Decode stage at full size, then crop + resize: the pixels a full-scale
    ROI decoder gives (its difference from (a) is that of the DCT scaling alone)."""

    name = "full decode, crop"

    def __init__(self, augment: RandomResizedCropFlip):
        super().__init__(augment)
        self.decode.set_consumer_need(None)


class NvImageCodec:
    """(b) nvImageCodec's CPU decoder (libjpeg-turbo) on the crop window only, full scale."""

    name = "nvimgcodec ROI"

    def __init__(self, augment: RandomResizedCropFlip):
        from nvidia import nvimgcodec  # installed with nvidia-dali-cuda120

        self.nvimgcodec, self.augment = nvimgcodec, augment
        self.decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                          backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
        self.decoded_pixels = 0

    def run(self, files: list, boxes: list, out: np.ndarray) -> None:
        self.decoded_pixels = 0
        region = self.nvimgcodec.Region
        for start in range(0, len(files), BATCH_SIZE):
            streams = []
            for i, (_, data, _, _) in enumerate(files[start:start + BATCH_SIZE], start):
                simplejpeg.decode_jpeg_header(data)  # a fused stage reads the size to draw the box
                x0, y0, x1, y1 = boxes[i]
                streams.append(self.nvimgcodec.CodeStream(data).get_sub_code_stream(
                    region=region(start=(y0, x0), end=(y1, x1))))
            for i, image in enumerate(self.decoder.decode(streams), start):
                crop = np.asarray(image.cpu())
                self.augment._resize(crop, dst=out[i])
                self.decoded_pixels += crop.shape[0] * crop.shape[1]


class DaliSlice:
    """(b) DALI's CPU `decoders.image_slice` (device_id=None, 1 thread), windows from external_source."""

    name = "DALI image_slice"

    def __init__(self, augment: RandomResizedCropFlip):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=BATCH_SIZE, num_threads=1, device_id=None, prefetch_queue_depth=1,
                      exec_async=False, exec_pipelined=False)
        def slice_pipeline():
            jpegs = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            anchor = fn.external_source(name="anchor", dtype=types.FLOAT, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.FLOAT, ndim=1)
            return fn.decoders.image_slice(jpegs, anchor, shape, axis_names="WH", normalized_anchor=False,
                                           normalized_shape=False, device="cpu", output_type=types.RGB)

        self.augment = augment
        self.pipe = slice_pipeline()
        self.pipe.build()
        self.decoded_pixels = 0

    def run(self, files: list, boxes: list, out: np.ndarray) -> None:
        self.decoded_pixels = 0
        for start in range(0, len(files), BATCH_SIZE):
            chunk = files[start:start + BATCH_SIZE]
            anchors, shapes = [], []
            for i, (_, data, _, _) in enumerate(chunk, start):
                simplejpeg.decode_jpeg_header(data)  # a fused stage reads the size to draw the box
                x0, y0, x1, y1 = boxes[i]
                anchors.append(np.array([x0, y0], np.float32))
                shapes.append(np.array([x1 - x0, y1 - y0], np.float32))
            self.pipe.feed_input("encoded", [np.frombuffer(data, np.uint8) for _, data, _, _ in chunk])
            self.pipe.feed_input("anchor", anchors)
            self.pipe.feed_input("shape", shapes)
            (decoded,) = self.pipe.run()
            for i in range(len(chunk)):
                crop = np.array(decoded[i])
                self.augment._resize(crop, dst=out[start + i])
                self.decoded_pixels += crop.shape[0] * crop.shape[1]


class TurboCropScale:
    """(b) PyTurboJPEG 1.x: lossless crop to the iMCU-aligned window, then a DCT-scaled decode of it."""

    name = "turbojpeg crop+scale"

    def __init__(self, augment: RandomResizedCropFlip):
        import turbojpeg  # pip install 'PyTurboJPEG<2' and apt-get install libturbojpeg0

        self.turbojpeg, self.augment = turbojpeg, augment
        self.jpeg = turbojpeg.TurboJPEG()
        self.decoded_pixels = 0

    def run(self, files: list, boxes: list, out: np.ndarray) -> None:
        self.decoded_pixels = 0
        tj = self.turbojpeg
        for i, (_, data, _, _) in enumerate(files):
            _, _, subsample, _ = self.jpeg.decode_header(data)
            x0, y0, x1, y1 = boxes[i]
            # Crop origins must fall on the iMCU grid; the window may end anywhere.
            ax, ay = x0 - x0 % tj.tjMCUWidth[subsample], y0 - y0 % tj.tjMCUHeight[subsample]
            (window,) = self.jpeg.crop_multiple(data, [(ax, ay, x1 - ax, y1 - ay)], copynone=True)
            self.decode_window(window, ax, ay, boxes[i], out[i])

    def decode_window(self, window: bytes, ax: int, ay: int, box: tuple, out: np.ndarray) -> None:
        """Decode a cut window (its origin at (ax, ay) of the image) at the largest DCT reduction that
        keeps the crop's shorter side >= the output size; resize the crop `box` of it into `out`."""
        x0, y0, x1, y1 = box
        f = next((f for f in DCT_SCALES if min(x1 - x0, y1 - y0) * f >= self.augment.size), DCT_SCALES[-1])
        image = self.jpeg.decode(window, pixel_format=self.turbojpeg.TJPF_RGB,
                                 scaling_factor=(f.numerator, f.denominator))
        h, w = image.shape[:2]
        cx0, cy0 = math.floor((x0 - ax) * f), math.floor((y0 - ay) * f)
        crop = image[cy0:max(min(h, math.ceil((y1 - ay) * f)), cy0 + 1),
                     cx0:max(min(w, math.ceil((x1 - ax) * f)), cx0 + 1)]
        self.augment._resize(crop, dst=out)
        self.decoded_pixels += h * w


class ScaledWindowBound(TurboCropScale):
    """Bound, not a path: the crop+scale decode with its lossless cut done beforehand,
    untimed. No binding decodes a window at a DCT scale in one pass (libjpeg-turbo 3's
    tj3SetCroppingRegion with tj3SetScalingFactor; jpeg_crop_scanline with scale_denom);
    such a decoder skips the IDCT, upsampling and colour conversion outside the window
    but must still entropy-decode every row down to the window's bottom. So it costs
    more than a decode of the window alone (this bound, `full_rows` False) and less
    than one of the full-width rows down to its bottom (`full_rows` True)."""

    name = "bound: window, scaled"
    full_rows = False  # cut the whole rows 0 .. y1 instead of the window

    def prepare(self, files: list, boxes: list) -> None:
        self.windows = []
        tj = self.turbojpeg
        for i, (_, data, _, width) in enumerate(files):
            _, _, subsample, _ = self.jpeg.decode_header(data)
            x0, y0, x1, y1 = boxes[i]
            if self.full_rows:
                ax, ay, x1 = 0, 0, width
            else:
                ax, ay = x0 - x0 % tj.tjMCUWidth[subsample], y0 - y0 % tj.tjMCUHeight[subsample]
            (window,) = self.jpeg.crop_multiple(data, [(ax, ay, x1 - ax, y1 - ay)], copynone=True)
            self.windows.append((window, ax, ay))

    def run(self, files: list, boxes: list, out: np.ndarray) -> None:
        self.decoded_pixels = 0
        for i, (window, ax, ay) in enumerate(self.windows):
            self.decode_window(window, ax, ay, boxes[i], out[i])


class ScaledRowsBound(ScaledWindowBound):
    """Bound, not a path: the other side of `ScaledWindowBound`."""

    name = "bound: rows to y1, scaled"
    full_rows = True


CONTENDERS = [Today, FullDecode, NvImageCodec, DaliSlice, TurboCropScale, ScaledWindowBound, ScaledRowsBound]


# --- Measurement ----------------------------------------------------------------------

def measure(files: list, size: int, rounds: int, passes: int) -> dict:
    """CPU-seconds per round of each contender, in rotation; outputs checked against (a)."""
    augment = RandomResizedCropFlip(size=size, scale=SCALE)
    boxes = draw_boxes(augment, files)
    contenders, skipped = [], {}
    for cls in CONTENDERS:
        try:
            contenders.append(cls(augment))
        except (ImportError, OSError, RuntimeError) as err:  # not installed, or no library for it
            skipped[cls.name] = f"{type(err).__name__}: {err}".splitlines()[0]
    for c in contenders:
        if hasattr(c, "prepare"):
            c.prepare(files, boxes)
    outputs = {c.name: np.zeros((len(files), size, size, 3), np.uint8) for c in contenders}
    for c in contenders:  # untimed: warms caches and pipelines, and gives the outputs to compare
        c.run(files, boxes, outputs[c.name])
    reference = outputs[contenders[0].name].astype(np.int16)
    full = outputs[FullDecode.name].astype(np.int16) if FullDecode.name in outputs else reference
    cpu_s: dict[str, list[float]] = {c.name: [] for c in contenders}
    wall_s: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(passes):
                c.run(files, boxes, outputs[c.name])
            cpu_s[c.name].append(time.process_time() - cpu)
            wall_s[c.name].append(time.perf_counter() - wall)
    images = len(files) * passes
    base = images / statistics.median(cpu_s[contenders[0].name])
    rows = []
    for c in contenders:
        rate = images / statistics.median(cpu_s[c.name])
        out = outputs[c.name]
        rows.append({"contender": c.name, "images_per_cpu_s": rate, "ratio": rate / base,
                     "images_per_wall_s": images / statistics.median(wall_s[c.name]),
                     "decoded_mpix_per_image": c.decoded_pixels / len(files) / 1e6,
                     "shape_ok": out.shape == (len(files), size, size, 3) and out.dtype == np.uint8,
                     "mean_abs_diff": float(np.abs(out.astype(np.int16) - reference).mean()),
                     "mean_abs_diff_full": float(np.abs(out.astype(np.int16) - full).mean()),
                     "cpu_s": cpu_s[c.name]})
    return {"size": size, "images": len(files), "passes": passes, "rows": rows, "skipped": skipped}


def print_table(result: dict) -> None:
    print(f"\n{result['size']} px output, {result['images']} images x {result['passes']} passes, "
          f"median of {len(result['rows'][0]['cpu_s'])} rounds")
    print(f"{'contender':<24}{'img/CPU-s':>10}{'vs (a)':>8}{'img/wall-s':>11}{'decoded Mpx':>12}"
          f"{'shape':>7}{'MAD vs (a)':>11}{'vs full':>9}")
    for row in result["rows"]:
        print(f"{row['contender']:<24}{row['images_per_cpu_s']:>10.0f}{row['ratio']:>8.2f}"
              f"{row['images_per_wall_s']:>11.0f}{row['decoded_mpix_per_image']:>12.3f}"
              f"{'ok' if row['shape_ok'] else 'BAD':>7}{row['mean_abs_diff']:>11.2f}{row['mean_abs_diff_full']:>9.2f}")
    for name, reason in result["skipped"].items():
        print(f"{name:<24}skipped: {reason}")


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="roi_jpegs_") as temp:
        folder = args.images
        if folder is None:
            folder = Path(temp)
            make_jpegs(folder, args.count)
        files = load_files(folder)
    if not files:
        raise SystemExit(f"no colour or grey JPEGs under {folder}")
    sides = [min(h, w) for _, _, h, w in files]
    load_before = os.getloadavg()  # other users' load skews the wall rates; CPU rates much less
    print(f"{len(files)} JPEGs from {args.images or 'a synthetic set'}, shorter side "
          f"{min(sides)}-{max(sides)} px (median {statistics.median(sides):.0f}); {os.cpu_count()} cores; "
          f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    results = []
    for size in args.sizes:
        results.append(measure(files, size, args.rounds, args.passes))
        print_table(results[-1])
    load_after = os.getloadavg()
    print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command_args": vars(args), "results": results,
                                         "load_average_before": load_before, "load_average_after": load_after},
                                        indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
