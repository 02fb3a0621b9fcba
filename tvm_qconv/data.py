"""Calibration and evaluation images, preprocessed like torchvision's ImageNet eval recipe.

* ``load_calibration_images``: a folder of JPEG/PNG files, or (no folder) the real
  photographs bundled inside scikit-image, which need no download.
* ``digits_dataset``: scikit-learn's bundled 8x8 handwritten digits, upsampled to RGB
  NCHW tensors, for training and evaluating small CNNs offline.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import skimage.data
from PIL import Image
from skimage.util import img_as_float32

from .errors import InputError
from .progress import bar

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")

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


def preprocess(img: np.ndarray, size: int) -> np.ndarray:
    """Turn an image into a normalized CHW tensor (torchvision's ImageNet eval recipe).

    Resize so the short side is ``round(size * 256 / 224)`` (256 for 224), center-crop
    ``size x size``, scale to [0, 1] and normalize by ``IMAGENET_MEAN`` / ``IMAGENET_STD``.

    Args:
        img: HxW (grayscale), HxWx1, HxWx2 (grayscale + alpha), HxWx3 or HxWx4 (alpha is
            dropped: :func:`load_image` composites a file's alpha over white before this);
            uint8/uint16/bool, or float already in [0, 1].
        size: output height and width.

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

    h, w = img.shape[:2]
    short = round(size * 256 / 224)
    # Same arithmetic as torchvision.transforms.Resize(int): the long side is truncated.
    if h <= w:
        new_h, new_w = short, int(short * w / h)
    else:
        new_h, new_w = int(short * h / w), short
    img = resize(img, (new_h, new_w, 3), order=1, anti_aliasing=True)
    # Same offsets as torchvision.transforms.CenterCrop.
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    img = img[top : top + size, left : left + size]

    mean = np.asarray(IMAGENET_MEAN, dtype=np.float32)
    std = np.asarray(IMAGENET_STD, dtype=np.float32)
    img = (img.astype(np.float32) - mean) / std
    return np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.float32)


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

    Args:
        path: image file (JPEG, PNG, GIF, TIFF, BMP, WebP, anything Pillow reads), or
            ``skimage:NAME`` for one of ``SKIMAGE_PHOTOS``.
        size: output height and width.

    Returns:
        float32 array of shape ``(3, size, size)`` (see :func:`preprocess`).

    Raises:
        InputError: the file cannot be read as an image, its mode has no RGB conversion, or its
            values lie outside the range its mode allows (F: [0, 1]; I: 0..65535).
    """
    if str(path).startswith("skimage:"):  # e.g. skimage:coffee, a photo shipped with scikit-image
        return preprocess(_skimage_photo(str(path)[len("skimage:"):]), size)
    return preprocess(read_rgb(path), size)


# Modes with an alpha channel (premultiplied "La" has no conversion in Pillow: refused by name).
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "PA")


def read_rgb(path: str | Path) -> np.ndarray:
    """The first frame of an image file as an RGB (or grayscale) array, converted by mode as
    :func:`load_image` describes.

    Args:
        path: image file.

    Returns:
        HxWx3 uint8 (RGB), HxW uint8 (grayscale) or HxW / HxWx3 float32 in [0, 1] (16/32-bit
        integer or float grayscale, or composited over white): what :func:`preprocess` takes.

    Raises:
        InputError: the file is unreadable, its mode cannot be converted to RGB, or its values
            lie outside its mode's range.
    """
    try:
        with Image.open(path) as img:
            img.seek(0)  # the first frame of a GIF / multi-page TIFF
            img.load()
            return _to_rgb(img, path)
    except InputError:
        raise
    except Exception as err:  # Pillow raises many types (OSError, SyntaxError, ...): all mean "not a usable image"
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise InputError(f"cannot read image {path}: {reason}; give a JPEG or PNG file") from err


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
    folder: str | Path | None, size: int, limit: int | None = None
) -> np.ndarray:
    """Load calibration images.

    Args:
        folder: folder of ``*.jpg`` / ``*.jpeg`` / ``*.png`` files (any case), read in
            name order; ``None`` uses scikit-image's bundled photos.
        size: output height and width.
        limit: use at most this many images (``None``: all).

    Returns:
        float32 array of shape ``(N, 3, size, size)``.

    Raises:
        InputError: the folder is missing or has no images, a file is unreadable, or
            ``limit < 1``.
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
    )[:limit]
    if not files:
        raise InputError(
            f"no JPEG/PNG images in calibration folder {folder}: add some, "
            "or omit --calib-dir to use scikit-image's sample photos"
        )

    shown = bar(files, enabled=len(files) > _PROGRESS_MIN_FILES, desc="calibration images", unit="img")
    return np.stack([load_image(f, size) for f in shown])


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
