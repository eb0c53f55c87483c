"""Decode stage: file bytes to RGB images, with simplejpeg, Pillow or DALI (CPU)."""
from __future__ import annotations

import enum
import io
import re
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Stage, StageError


class DecodeBackend(enum.StrEnum):
    simplejpeg = "simplejpeg"  # libjpeg-turbo, at a reduced DCT scale when consumers need less
    pillow = "pillow"
    dali = "dali"  # a DALI CPU pipeline (device_id=None)


JPEG_MAGIC = b"\xff\xd8"
PNG_MAGIC = b"\x89PNG"


@dataclass
class Decode(Stage):
    """JPEGs go through libjpeg-turbo (simplejpeg), at a reduced DCT size when
    every consumer is content with less; other formats through Pillow."""

    backend: str = "simplejpeg"  # simplejpeg | pillow | dali (CPU, device_id=None)
    min_size: int | None = None  # shorter side to keep when decoding at reduced size; None: what consumers need
    dali_threads: int = 1  # DALI's own threads per Dask worker thread

    role: ClassVar[Role] = Role.MAP
    accepts: ClassVar[DataKind | None] = DataKind.ENCODED
    same_every_epoch: ClassVar[bool] = True

    consumer_side: int | None = field(init=False, default=None)  # set by the graph from the consumers

    def __post_init__(self) -> None:
        if self.backend not in DecodeBackend.__members__:  # a pipeline.stages override bypasses the schema
            raise StageError(f"backend must be one of {', '.join(DecodeBackend)}, got {self.backend!r}")
        if self.min_size is not None and self.min_size < 1:
            raise StageError(f"min_size must be a positive pixel count or null, got {self.min_size}")

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return Spec(DataKind.IMAGES)

    def set_consumer_need(self, side: int | None) -> None:
        self.consumer_side = side

    @property
    def keep_side(self) -> int:
        """Shorter side below which decoding must not reduce the image (0: full size)."""
        side = self.min_size if self.min_size is not None else self.consumer_side
        return 0 if self.backend != "simplejpeg" or side is None else side

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        assert batch is not None
        decoded: list[np.ndarray | None] = [None] * len(batch.data)
        if self.backend == "dali":
            self._decode_sound_files_with_dali(batch.data, decoded)
        for i in [i for i, image in enumerate(decoded) if image is None]:  # all, but for DALI's
            decoded[i] = self._decode_one(batch.data[i], batch.paths[i], ctx)
        kept = [i for i, image in enumerate(decoded) if image is not None]  # skipped files leave the batch
        return Batch([decoded[i] for i in kept], batch.labels[kept], [batch.paths[i] for i in kept])

    def _decode_sound_files_with_dali(self, encoded: list[bytes], decoded: list) -> None:
        """Into `decoded`, DALI's decoding of the files it can take. DALI fails a whole batch for one bad
        file, naming it: the sound colour JPEGs (their headers say so) go to DALI, a body it names as
        bad is left out and the rest go again; what is left is for the per-file path, where bad files
        are named and conversions noted."""
        todo = [i for i, data in enumerate(encoded) if _sound_colour_jpeg(data)]
        while todo:
            try:
                images = _decode_with_dali([encoded[i] for i in todo], self.dali_threads)
            except DaliRejected as err:
                if err.sample is None:
                    return  # it did not say which
                del todo[err.sample]
                continue
            for i, image in zip(todo, images):  # turned upright here, as the other paths are: DALI reads no XMP
                decoded[i] = _oriented(image, _jpeg_orientation(encoded[i]))
            return

    def _decode_one(self, data: bytes, path: str, ctx: BatchContext) -> np.ndarray | None:
        if not data:
            ctx.reject(path, "empty file")
            return None
        if data.startswith(JPEG_MAGIC) and self.backend != "pillow":
            try:
                height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
                if colorspace in ("YCbCr", "Gray"):
                    least = _least_size(height, width, self.keep_side)
                    refusal = _past_pixel_limit(height * width)
                    if refusal and not _held_whole(data):  # a sequential JPEG takes what it decodes to, maybe less
                        decoded = simplejpeg.decode_jpeg_header(data, *least)
                        refusal = _past_pixel_limit(decoded[0] * decoded[1])
                    if refusal:
                        ctx.reject(path, refusal)
                        return None
                    if colorspace == "Gray":
                        ctx.converted.append((path, "grayscale JPEG expanded to RGB"))
                    image = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=least[0], min_width=least[1])
                    return _oriented(image, _jpeg_orientation(data))
            except ValueError as err:
                ctx.reject(path, f"corrupt or truncated JPEG: {err}")
                return None
        return _decode_with_pillow(data, path, ctx)


def _least_size(height: int, width: int, keep_side: int) -> tuple[int, int]:
    """The least height and width to decode a `height` x `width` JPEG to, its shorter side kept at `keep_side`
    or more and its aspect ratio kept: libjpeg-turbo scales in the DCT, in eighths, to the smallest that
    holds both. (0, 0) (`keep_side` 0): full size."""
    if not keep_side:
        return 0, 0
    scale = keep_side / min(height, width)
    return int(np.ceil(height * scale)), int(np.ceil(width * scale))


# EXIF orientation (1: as stored) -> what shows the image upright, on an array of rows, columns, channels
# (as DALI, OpenCV and Pillow's ImageOps.exif_transpose turn it; a camera held sideways stores it so)
_ORIENT = {2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
           5: lambda a: a.swapaxes(0, 1), 6: lambda a: a[::-1].swapaxes(0, 1),
           7: lambda a: a[::-1, ::-1].swapaxes(0, 1), 8: lambda a: a[:, ::-1].swapaxes(0, 1)}


def _oriented(image: np.ndarray, orientation: int) -> np.ndarray:
    """`image` turned upright by its orientation (EXIF's numbers, as `_jpeg_orientation` reads them)."""
    turn = _ORIENT.get(orientation)
    return image if turn is None else np.ascontiguousarray(turn(image))


def _jpeg_headers(data: bytes) -> Iterator[tuple[int, memoryview]]:
    """A JPEG's header segments, (marker, its bytes after the length), up to the first scan."""
    view, at = memoryview(data), 2
    while at + 4 <= len(view) and view[at] == 0xFF:
        marker = view[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no header follows
            return
        length = int.from_bytes(view[at + 2:at + 4], "big")
        yield marker, view[at + 4:at + 2 + length]
        at += 2 + length


XMP_HEADER = b"http://ns.adobe.com/xap/1.0/\0"
XMP_ORIENTATION = re.compile(rb'tiff:Orientation(?:="|>)([0-9])')  # an attribute or an element, as Pillow reads it


def _jpeg_orientation(data: bytes) -> int:
    """The orientation (1-8) a JPEG declares, read from its headers alone as Pillow reads it: its first EXIF
    block's tag, else its last XMP packet's tiff:Orientation (some editors write only that); 1 where it
    declares none or nonsense. (Pillow's Image.open and getexif take 6x as long, 26 us a 44 KB file against 4
    and a 716 us decode, and raise or return other types on a malformed block.)"""
    exif_read, xmp = False, None
    for marker, segment in _jpeg_headers(data):
        if marker == 0xE1 and segment[:6] == b"Exif\0\0" and not exif_read:
            exif_read, tagged = True, _tiff_orientation(segment[6:])
            if tagged is not None:
                return tagged if tagged in range(1, 9) else 1
        elif marker == 0xE1 and segment[:len(XMP_HEADER)] == XMP_HEADER:
            found = XMP_ORIENTATION.search(segment)
            xmp = found and int(found[1])
    return xmp if xmp in range(1, 9) else 1


FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (the others: other segments)
SEQUENTIAL_FRAMES = frozenset({0xC0, 0xC1, 0xC9})  # baseline, extended, arithmetic: decoded a band of rows at a time


def _held_whole(data: bytes) -> bool:
    """Whether libjpeg-turbo holds a JPEG whole as it decodes (its coefficients, at full size), whatever the
    scale it outputs: a progressive frame (or lossless, hierarchical) rather than a sequential one."""
    frame = next((marker for marker, _ in _jpeg_headers(data) if marker in FRAMES), None)
    return frame is not None and frame not in SEQUENTIAL_FRAMES


def _tiff_orientation(tiff: memoryview) -> int | None:
    """The orientation tag (0x0112) of an EXIF block's first IFD, as stored; None where it has none or the
    block is malformed."""
    order = {b"II": "little", b"MM": "big"}.get(bytes(tiff[:2]))
    if order is None or len(tiff) < 8:
        return None
    ifd = int.from_bytes(tiff[4:8], order)
    entries = int.from_bytes(tiff[ifd:ifd + 2], order) if ifd + 2 <= len(tiff) else 0
    for entry in range(ifd + 2, min(ifd + 2 + 12 * entries, len(tiff) - 11), 12):
        if int.from_bytes(tiff[entry:entry + 2], order) == 0x0112:
            kind = int.from_bytes(tiff[entry + 2:entry + 4], order)
            # The SHORT the standard says, a LONG where some writers put it, or their signed kinds (and SBYTE);
            # a BYTE or a string is no number to Pillow: the image as stored. (Pillow reads a float or a
            # rational too, which no writer puts there: taken as stored here.)
            width = {3: 2, 8: 2, 4: 4, 9: 4, 6: 1}.get(kind)
            return int.from_bytes(tiff[entry + 8:entry + 8 + width], order) if width else 0
    return None


def _past_pixel_limit(pixels: int) -> str | None:
    """Why an image decoded to `pixels` is refused (None: it is not): past the size at which Pillow refuses
    to open one (twice `PIL.Image.MAX_IMAGE_PIXELS`, 179 million by default: a gigapixel scan, gigabytes
    once decoded in a worker), so that no backend decodes past Pillow's limit."""
    limit = Image.MAX_IMAGE_PIXELS and 2 * Image.MAX_IMAGE_PIXELS
    if limit and pixels > limit:
        return f"too large to decode: Image size ({pixels} pixels) exceeds limit of {limit} pixels; downscale it"
    return None


def _sound_colour_jpeg(data: bytes) -> bool:
    """A JPEG whose header parses, in YCbCr, within the pixel limit at full size: what DALI decodes as is
    (grey and CMYK are noted, and large images refused, on the per-file path)."""
    if not data.startswith(JPEG_MAGIC):
        return False
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return False
    return colorspace == "YCbCr" and not _past_pixel_limit(height * width)


def _decode_with_pillow(data: bytes, path: str, ctx: BatchContext) -> np.ndarray | None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            kind = f"{image.format} {image.mode}"
            ImageOps.exif_transpose(image, in_place=True)  # upright, as the JPEG path turns it
            rgb, how = (np.asarray(image), None) if image.mode == "RGB" else _as_rgb(image)
    except UnidentifiedImageError:
        ctx.reject(path, "not an image (unrecognised format)")
        return None
    except Image.DecompressionBombError as err:  # in the words of _past_pixel_limit's, for one message
        ctx.reject(path, f"too large to decode: {str(err).partition(', could be')[0]}; downscale it")
        return None
    except (OSError, ValueError, SyntaxError) as err:
        ctx.reject(path, f"corrupt or truncated image: {err}")
        return None
    if rgb is None:
        ctx.reject(path, f"{kind}: {how}")
        return None
    notes = [f"{kind} {how}"] if how else []
    if data.startswith(PNG_MAGIC) and path.lower().endswith((".jpg", ".jpeg")):
        notes.insert(0, "PNG data in a .jpg file, decoded as PNG")
    if notes:
        ctx.converted.append((path, "; ".join(notes)))
    return rgb


def _as_rgb(image: Image.Image) -> tuple[np.ndarray | None, str]:
    """`image`, in a mode other than RGB, as 8-bit RGB (None: no 8-bit meaning is known), and how. 16-bit
    grey keeps its scale, its high byte as Pillow does for 16-bit colour (its own conversion clips grey at
    255: a white image); 32-bit integer or float grey converts only where its values lie in 0-255."""
    if image.mode.startswith("I;16") or (image.mode == "I" and image.format == "PNG"):  # (older Pillow: I)
        grey = (np.asarray(image).astype(np.uint16) >> 8).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2), "scaled to 8 bits and converted to RGB"
    if image.mode in ("I", "F"):
        values = np.asarray(image)
        if values.size and not 0 <= values.min() <= values.max() <= 255:
            return None, (f"32-bit values from {values.min():g} to {values.max():g}, whose 8-bit scale is not known; "
                          "save the image with 8 or 16 bits per channel")
    return np.asarray(image.convert("RGB")), "converted to RGB"


class DaliRejected(Exception):
    """DALI could not decode a batch; `sample`: the index of the file it named, if it did."""

    def __init__(self, sample: int | None):
        super().__init__(f"sample {sample}")
        self.sample = sample


DALI_BAD_SAMPLE = re.compile(r"Failed to decode sample #(\d+)")

# One DALI pipeline per worker process and batch capacity: building one costs ~100 ms.
_dali_pipelines: dict[tuple[int, int], object] = {}


def _decode_with_dali(encoded: list[bytes], threads: int) -> list[np.ndarray]:
    """Decode files with DALI's CPU decoder; DaliRejected when it cannot decode one of them."""
    from nvidia.dali import fn, pipeline_def, types  # imported lazily: DALI is large

    capacity = 1 << (len(encoded) - 1).bit_length()  # reuse pipelines across batch sizes
    key = (capacity, threads)
    if key not in _dali_pipelines:
        @pipeline_def(batch_size=capacity, num_threads=threads, device_id=None, prefetch_queue_depth=1)
        def decode_pipeline():
            files = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            return fn.decoders.image(files, device="cpu", output_type=types.RGB, adjust_orientation=False)

        pipe = decode_pipeline()
        pipe.build()
        _dali_pipelines[key] = pipe
    pipe = _dali_pipelines[key]
    try:
        pipe.feed_input("encoded", [np.frombuffer(data, dtype=np.uint8) for data in encoded])
        (decoded,) = pipe.run()
    except RuntimeError as err:
        _dali_pipelines.pop(key)  # a pipeline that raised is not reused
        named = DALI_BAD_SAMPLE.search(str(err))
        raise DaliRejected(int(named.group(1)) if named else None) from None
    return [np.array(decoded[i]) for i in range(len(encoded))]
