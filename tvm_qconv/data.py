"""Calibration and evaluation images, preprocessed like torchvision's ImageNet eval recipe.

* ``load_calibration_images``: a folder of image files (``IMAGE_SUFFIXES``: the formats
  ``eval --data`` reads too), or (no folder) the real photographs bundled inside scikit-image,
  which need no download.
* ``load_image``: one file, decoded at a reduced size first where it is many times larger than
  the resize needs (``read_rgb``), so a 12000 x 12000 photo costs what a 1500 x 1500 one does.
* ``digits_dataset``: scikit-learn's bundled 8x8 handwritten digits, upsampled to RGB
  NCHW tensors, for training and evaluating small CNNs offline.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from pathlib import Path

import numpy as np
import skimage.data
from PIL import Image
from skimage.util import img_as_float32

from .errors import InputError
from .fileio import file_kind
from .progress import bar

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The files read as images wherever a folder is read (--calib-dir, eval / compare --data): the
# formats Pillow decodes that cameras and datasets use.  One list, so a folder means the same
# images to calibration and to evaluation.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")

# Decoding at a reduced size (read_rgb): an image whose short side is at most FULL_DECODE_RATIO
# times the resize's short side (4096 px for 224) is decoded whole, so every photo of a camera up
# to 24 MP (6000 x 4000) gives the tensor it always gave, bit for bit.  A larger one is decoded
# reduced by an integer factor (JPEG: Pillow's DCT scaling, 1/2 .. 1/8; others: a box average)
# that keeps its short side at least REDUCED_RATIO times the resize's (1024 px): the resize's
# anti-aliasing blur then still spans several decoded pixels, and is the full image's blur (see
# preprocess), so the result is within 0.7/255 of the whole decode's on average (0.15/255 at 224
# px; tests/test_image_modes.py), and a 12000 x 12000 JPEG takes 1.2 s and 140 MB, not 3 min and 3.4 GB.
FULL_DECODE_RATIO = 16
REDUCED_RATIO = 4

# skimage.data photographs whose files ship inside the scikit-image wheel (checked with
# scikit-image 0.26 and no pooch/network: eagle, lily, brain, kidney, skin and cells3d
# are fetched lazily and fail offline). ``cat`` is left out: it is ``chelsea`` again.
# Synthetic or binary images (logo, colorwheel, horse, text, page) are left out too:
# calibration ranges should come from natural-image statistics.
SKIMAGE_PHOTOS = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "stereo_motorcycle",
    "camera",
    "coins",
    "clock",
    "moon",
    "brick",
    "grass",
    "gravel",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
)
_PROGRESS_MIN_FILES = 8  # a progress bar for a handful of files is just noise


def preprocess(img: np.ndarray, size: int, *, reduced_by: int = 1,
               full_shape: tuple[int, int] | None = None) -> np.ndarray:
    """Turn an image into a normalized CHW tensor (torchvision's ImageNet eval recipe).

    Resize so the short side is ``round(size * 256 / 224)`` (256 for 224), center-crop
    ``size x size``, scale to [0, 1] and normalize by ``IMAGENET_MEAN`` / ``IMAGENET_STD``.

    Args:
        img: HxW (grayscale), HxWx1, HxWx2 (grayscale + alpha), HxWx3 or HxWx4 (alpha is
            dropped: :func:`load_image` composites a file's alpha over white before this);
            uint8/uint16/bool, or float already in [0, 1].
        size: output height and width.
        reduced_by, full_shape: ``img`` was decoded at ``1 / reduced_by`` of an image of
            ``full_shape`` (height, width) (:func:`read_rgb`): its pixel ``(i, j)`` averages the
            full image's ``[i r, (i + 1) r) x [j r, (j + 1) r)``, as JPEG's DCT scaling and
            ``Image.reduce`` do.  The resize then samples where the whole image's resize samples,
            with the whole image's anti-aliasing blur, so the result is the whole decode's up to
            the reduction's averaging.  1 (default): ``img`` is the whole image.

    Returns:
        float32 array of shape ``(3, size, size)``.

    Raises:
        InputError: the array is not an image of a supported shape, or ``size < 1``.
    """
    # scikit-image's resize brings scipy (~0.8 s to import): train.py and `deploy.py eval` (the digits) need none
    from skimage.transform import resize

    if size < 1:
        raise InputError(f"image size must be >= 1, got {size}")
    img = np.asarray(img)
    if img.ndim == 3 and img.shape[2] in (1, 2):
        img = img[:, :, 0]  # grayscale (+ alpha)
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    elif img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, :3]  # RGBA: drop alpha
    if img.ndim != 3 or img.shape[2] != 3 or min(img.shape[:2]) < 1:
        raise InputError(
            f"expected an HxW, HxWx3 or HxWx4 image, got an array of shape {img.shape}; "
            "give an RGB or grayscale JPEG/PNG"
        )
    img = img_as_float32(img)  # uint8 / 255, uint16 / 65535; float kept as is

    h, w = full_shape if reduced_by > 1 else img.shape[:2]
    short = resize_short_side(size)
    # Same arithmetic as torchvision.transforms.Resize(int): the long side is truncated.
    if h <= w:
        new_h, new_w = short, int(short * w / h)
    else:
        new_h, new_w = int(short * h / w), short
    if reduced_by > 1:
        img = _resize_reduced(img, (h, w), reduced_by, (new_h, new_w))
    else:
        img = resize(img, (new_h, new_w, 3), order=1, anti_aliasing=True)
    # Same offsets as torchvision.transforms.CenterCrop.
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    img = img[top : top + size, left : left + size]

    mean = np.asarray(IMAGENET_MEAN, dtype=np.float32)
    std = np.asarray(IMAGENET_STD, dtype=np.float32)
    img = (img.astype(np.float32) - mean) / std
    return np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.float32)


def _resize_reduced(img: np.ndarray, full_shape: tuple[int, int], r: int, new_shape: tuple[int, int]) -> np.ndarray:
    """What ``skimage.transform.resize(whole, new_shape, order=1, anti_aliasing=True)`` does to the
    whole image, done on ``img``, that image reduced by ``r`` (:func:`preprocess`).

    The same three steps as resize: a Gaussian blur of sigma ``(full / new - 1) / 2`` whole-image
    pixels (here divided by ``r``), linear interpolation at the whole image's sample points, a
    clip to the input's range.  resize itself cannot be used on ``img``: it would take
    ``img``'s rounded-up size (``ceil(full / r)``) for the whole image's ``full / r``, and shift
    and stretch the samples by up to a decoded pixel, ~1/8 of an output pixel (a 1200 x 900 JPEG
    at 16 px: 1.2/255 mean difference from the whole decode that way, 0.27/255 this way)."""
    from scipy import ndimage as ndi

    sigma = [max(0.0, (full / new - 1) / 2) / r for full, new in zip(full_shape, new_shape)] + [0.0]
    blurred = ndi.gaussian_filter(img, sigma, mode="mirror")  # skimage's mode "reflect" is ndimage's "mirror"
    # the output pixel i's center, (i + 0.5) * full / new - 0.5 in whole pixels, is
    # (i + 0.5) * (full / r) / new - 0.5 in decoded ones (decoded pixel j's center: j r + (r - 1) / 2)
    step = [full / r / new for full, new in zip(full_shape, new_shape)]
    out = ndi.affine_transform(blurred, [*step, 1.0], offset=[0.5 * a - 0.5 for a in step] + [0.0],
                               output_shape=(*new_shape, 3), order=1, mode="mirror")
    return np.clip(out, img.min(), img.max())


def resize_short_side(size: int) -> int:
    """The short side :func:`preprocess` resizes to before its center crop (256 for 224)."""
    return round(size * 256 / 224)


def load_image(path: str | Path, size: int) -> np.ndarray:
    """Read an image file, convert it to RGB and preprocess it.

    The file is read with Pillow and converted by its mode:

    * RGB as is; CMYK, YCbCr, LAB, HSV (and other colour modes) by Pillow's conversion to RGB;
    * grayscale ``L`` and bilevel ``1``: the gray level replicated to 3 channels;
    * palette ``P``: the palette's colours;
    * with an alpha channel or a transparent colour (RGBA, LA, PA, P or L with transparency):
      composited over white, as an image viewer shows it (transparent reads as white, not as
      the colour hidden under the alpha);
    * 16- and 32-bit integer grayscale (``I;16``, ``I;16B``, ``I``): scaled by the 16-bit
      range, 65535 -> 1.0 (a 32-bit value outside 0..65535 is refused);
    * float ``F``: taken as is, so its values must lie in [0, 1];
    * 16-bit RGB (48-bit PNG): Pillow keeps the high byte of each channel, so 8-bit colours;
    * multi-frame files (GIF, TIFF): the first frame.

    An image many times larger than ``size`` needs is decoded at a reduced size first
    (:data:`FULL_DECODE_RATIO`): a 12000 x 12000 JPEG reads in about a second.

    Args:
        path: image file (JPEG, PNG, GIF, TIFF, BMP, WebP, anything Pillow reads), or
            ``skimage:NAME`` for one of ``SKIMAGE_PHOTOS``.
        size: output height and width.

    Returns:
        float32 array of shape ``(3, size, size)`` (see :func:`preprocess`).

    Raises:
        InputError: the file cannot be read as an image, its mode has no RGB conversion, its
            values lie outside the range its mode allows (F: [0, 1]; I: 0..65535), or it has more
            pixels than Pillow's guard against decompression bombs lets through.
    """
    if str(path).startswith("skimage:"):  # e.g. skimage:coffee, a photo shipped with scikit-image
        return preprocess(_skimage_photo(str(path)[len("skimage:"):]), size)
    img, reduced_by, full_shape = _read(path, size)
    return preprocess(img, size, reduced_by=reduced_by, full_shape=full_shape)


# Modes with an alpha channel (premultiplied "La" has no conversion in Pillow: refused by name).
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "PA")


def read_rgb(path: str | Path, size: int | None = None) -> np.ndarray:
    """The first frame of an image file as an RGB (or grayscale) array, converted by mode as
    :func:`load_image` describes.

    Args:
        path: image file.
        size: the :func:`preprocess` size the array is for: an image many times larger is
            decoded at a reduced size (:data:`FULL_DECODE_RATIO`); None: always whole.

    Returns:
        HxWx3 uint8 (RGB), HxW uint8 (grayscale) or HxW / HxWx3 float32 in [0, 1] (16/32-bit
        integer or float grayscale, or composited over white): what :func:`preprocess` takes.

    Raises:
        InputError: the file is unreadable, its mode cannot be converted to RGB, its values
            lie outside its mode's range, or it is over Pillow's decompression-bomb limit.
    """
    return _read(path, size)[0]


def _read(path: str | Path, size: int | None) -> tuple[np.ndarray, int, tuple[int, int]]:
    """:func:`read_rgb`'s array, the factor it was reduced by and the whole image's (height, width)."""
    try:
        with warnings.catch_warnings():
            # Pillow warns from 89 MP and refuses from 179 MP (below): under that, a photo this
            # large is decoded reduced (JPEG) or costs < 1 GB, so the warning asks nothing of the user
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(path)
        with opened as img:
            img.seek(0)  # the first frame of a GIF / multi-page TIFF
            full_shape = (img.height, img.width)
            reduced_by = 1
            factor = _reduction(full_shape, size)
            if factor > 1:  # JPEG (and MPO): decoded by DCT scaling at 1/2, 1/4 or 1/8; others: None
                drafted = img.draft(img.mode, (img.width // factor, img.height // factor))
                if drafted is not None:  # (mode, box of the whole image in decoded pixels)
                    reduced_by = round(full_shape[1] / drafted[1][2])
            img.load()
            factor = _reduction((img.height, img.width), size)
            reducible = _reducible(img) if factor > 1 else None
            if reducible is not None:  # what draft could not reduce (PNG, TIFF, ...; or JPEG past 1/8)
                img, reduced_by = reducible.reduce(factor), reduced_by * factor
            return _to_rgb(img, path), reduced_by, full_shape
    except InputError:
        raise
    except Image.DecompressionBombError as err:
        # Pillow's message: "Image size (N pixels) exceeds limit of M pixels, could be decompression bomb ..."
        counts = [_pixels(int(n)) for n in re.findall(r"\d+", str(err))[:2]]
        said = f"{counts[0]}, over the limit of {counts[1]}" if len(counts) == 2 else "over the pixel limit"
        raise InputError(f"image {path} is {said} that guards against decompression bombs (a small file that "
                         "decodes to gigabytes): downscale it (to 4000 px on its long side, say) and give "
                         "that file") from None
    except Exception as err:  # Pillow raises many types (OSError, SyntaxError, ...): all mean "not a usable image"
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        kind = file_kind(str(path)) if os.path.isfile(path) else None
        kind = None if kind is not None and kind.startswith("an image") else kind   # an image Pillow cannot read
        raise InputError(f"cannot read image {path}: {'it is ' + kind if kind else reason}; give an image file (JPEG, PNG, BMP, WebP, "
                         "GIF, TIFF)") from err


def _pixels(n: int) -> str:
    return f"{n / 1e6:.0f} megapixels" if n >= 10 ** 6 else f"{n} pixels"


def _reduction(shape: tuple[int, int], size: int | None) -> int:
    """The integer factor to decode an image of ``shape`` reduced by, for :func:`preprocess` at
    ``size`` (1: whole), by the rule of :data:`FULL_DECODE_RATIO`."""
    if size is None:
        return 1
    target = resize_short_side(size)
    if min(shape) <= FULL_DECODE_RATIO * target:
        return 1
    return max(1, min(shape) // (REDUCED_RATIO * target))


def _reducible(img):
    """``img`` in a mode whose box average (``Image.reduce``) is the average colour :func:`_to_rgb`
    would see, or None where there is none (the image is then used whole)."""
    try:
        if img.mode in _ALPHA_MODES or "transparency" in img.info:
            # premultiplied: a transparent pixel's hidden colour adds nothing to its neighbours'
            return img.convert("RGBA").convert("RGBa")
        if img.mode in ("RGB", "L", "I", "F"):
            return img
        if img.mode == "1":
            return img.convert("L")
        if img.mode.startswith("I;16"):
            return img.convert("I")  # exact: _to_rgb reads I and I;16 alike (/ 65535)
        if img.mode == "P":
            return img.convert("RGB")
        if img.mode in ("CMYK", "YCbCr", "LAB", "HSV"):
            return img.convert("RGB")  # what _to_rgb converts them to anyway
    except ValueError:  # a mode Pillow cannot convert: _to_rgb says so
        pass
    return None


def _to_rgb(img, path) -> np.ndarray:
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return np.asarray(img)
    if mode in ("L", "1") and "transparency" not in img.info:
        return np.asarray(img.convert("L"))
    if mode == "I" or mode.startswith("I;16"):
        values = np.asarray(img).astype(np.float64)
        if values.size and (values.min() < 0 or values.max() > 65535):
            raise InputError(f"image {path} is 32-bit grayscale with values from {values.min():.0f} to "
                             f"{values.max():.0f}, outside the 16-bit range 0..65535 it is read in: save it "
                             f"as 8- or 16-bit")
        return (values / 65535.0).astype(np.float32)
    if mode == "F":
        values = np.asarray(img, dtype=np.float32)
        if values.size and not np.isfinite(values).all():
            raise InputError(f"image {path} is float (mode F) with NaN or infinite values, outside [0, 1]: "
                             f"scale it to [0, 1], or save it as 8-bit")
        if values.size and (values.min() < 0 or values.max() > 1):
            raise InputError(f"image {path} is float (mode F) with values from {values.min():g} to "
                             f"{values.max():g}, outside [0, 1]: scale it to [0, 1], or save it as 8-bit")
        return values
    try:
        if mode in _ALPHA_MODES or "transparency" in img.info:
            rgba = np.asarray(img.convert("RGBA"), dtype=np.float32) / 255.0
            alpha = rgba[:, :, 3:]
            return rgba[:, :, :3] * alpha + (1.0 - alpha)  # over white
        return np.asarray(img.convert("RGB"))
    except ValueError as err:  # Pillow: "conversion from X to Y not supported"
        raise InputError(f"image {path} has mode {mode}, which Pillow cannot convert to RGB ({err}): "
                         f"save it as RGB") from err


def _skimage_photo(name: str) -> np.ndarray:
    if name not in SKIMAGE_PHOTOS:
        raise InputError(f"skimage:{name} is not one of scikit-image's photos; choose from {', '.join(SKIMAGE_PHOTOS)}")
    img = getattr(skimage.data, name)()
    return img[0] if isinstance(img, tuple) else img  # stereo_motorcycle: (left, right, disparity)


@functools.lru_cache(maxsize=4)
def _skimage_photos_cached(size: int) -> np.ndarray:
    photos = []
    for name in SKIMAGE_PHOTOS:
        try:
            photos.append(preprocess(_skimage_photo(name), size))
        except Exception as err:  # noqa: BLE001 - a missing sample photo is not fatal
            log.debug("skipping skimage.data.%s: %s", name, err)
    if not photos:
        raise InputError(
            "none of scikit-image's sample photos could be loaded; "
            "pass a folder of JPEG/PNG calibration images (--calib-dir)"
        )
    out = np.stack(photos)
    out.flags.writeable = False  # cached: callers get copies
    return out


def skimage_photos(size: int) -> np.ndarray:
    """The real photographs bundled with scikit-image (``SKIMAGE_PHOTOS``), preprocessed.

    Photos that fail to load are skipped silently.

    Args:
        size: output height and width.

    Returns:
        float32 array of shape ``(N, 3, size, size)``, N <= len(SKIMAGE_PHOTOS).

    Raises:
        InputError: none of them could be loaded.
    """
    return _skimage_photos_cached(int(size)).copy()


def load_calibration_images(
    folder: str | Path | None, size: int, limit: int | None = None, skipped: list | None = None
) -> np.ndarray:
    """Load calibration images.

    Args:
        folder: folder of image files (``IMAGE_SUFFIXES``, any case: the formats ``eval --data``
            reads), read in name order; ``None`` uses scikit-image's bundled photos.
        size: output height and width.
        limit: use at most this many images (``None``: all).
        skipped: where given, ``(file, why)`` of each file left out as unreadable is appended.

    Returns:
        float32 array of shape ``(N, 3, size, size)``.  A file that cannot be read as an image is
        left out, and a warning names it: the next files take its place up to ``limit``.

    Raises:
        InputError: the folder is missing, has no images or none readable, or ``limit < 1``.
    """
    if limit is not None and limit < 1:
        raise InputError(f"the calibration image limit must be >= 1, got {limit}")
    if folder is None:
        return skimage_photos(size)[:limit]

    path = Path(folder)
    if not path.exists():
        raise InputError(f"calibration folder {folder} does not exist")
    if not path.is_dir():
        raise InputError(f"calibration folder {folder} is a file, not a folder")
    files = sorted(
        (f for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES),
        key=lambda f: f.name,
    )
    if not files:
        raise InputError(
            f"no images ({', '.join(IMAGE_SUFFIXES)}) in calibration folder {folder}: add "
            "some, or omit --calib-dir to use scikit-image's sample photos"
        )

    wanted = len(files) if limit is None else min(limit, len(files))
    images, left_out = [], []
    shown = bar(files, enabled=len(files) > _PROGRESS_MIN_FILES, desc="calibration images", unit="img")
    for f in shown:
        if len(images) == wanted:
            break
        try:
            images.append(load_image(f, size))
        except InputError as err:  # one bad file among many: the rest still calibrate
            left_out.append((str(f), str(err)))
    if skipped is not None:
        skipped.extend(left_out)
    if not images:
        raise InputError(f"none of the {len(files)} image files of calibration folder {folder} could be read "
                         f"(first: {left_out[0][1]})")
    if left_out:
        names = ", ".join(Path(f).name for f, _ in left_out[:6]) + (" ..." if len(left_out) > 6 else "")
        warnings.warn(f"calibration folder {folder}: left out {len(left_out)} unreadable file(s), {names} "
                      f"(first: {left_out[0][1]}); read {len(images)} others", stacklevel=2)
    return np.stack(images)


def digits_dataset(
    size: int = 32, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's handwritten digits (1797 real 8x8 scans, bundled) as RGB tensors.

    Pixels (0..16) are scaled to [0, 1], upsampled to ``size x size`` by nearest
    neighbour (so a multiple of 8 is an exact block copy), replicated to 3 channels and
    normalized to ``(x - 0.5) / 0.5``.

    Args:
        size: output height and width.
        seed: ``random_state`` of the split.

    Returns:
        ``((x_train, y_train), (x_test, y_test))``: float32 NCHW images and int64 labels,
        a stratified 80/20 split (1437 / 360 samples).
    """
    # scikit-learn takes ~2 s to import: the digits need it, the photos and files above (deploy.py run) do not
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if size < 1:
        raise InputError(f"image size must be >= 1, got {size}")
    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0  # (N, 8, 8) in [0, 1]
    src = np.arange(size) * images.shape[1] // size  # nearest source pixel per output pixel
    images = images[:, src][:, :, src]
    x = np.repeat(((images - 0.5) / 0.5)[:, None], 3, axis=1).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    return (x_train, y_train), (x_test, y_test)


def static_batches(images: np.ndarray, batch: int):
    """``(real images, float32 batch of exactly batch)`` over ``images``, in order: a compiled
    module has a static batch, so the last batch is padded with repeats of its own images (the
    caller keeps the first ``real`` rows of each output)."""
    for i in range(0, len(images), batch):
        x = images[i: i + batch]
        n = len(x)
        if n < batch:
            x = np.concatenate([x] * (-(-batch // n)))[:batch]
        yield n, np.ascontiguousarray(x, np.float32)
