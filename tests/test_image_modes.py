"""Facts about reading image files of every Pillow mode (``tvm_qconv.data.load_image``): each
becomes the RGB image a viewer shows, then the same tensor ``preprocess`` makes of that RGB array."""
import struct
import warnings
import zlib

import numpy as np
import pytest
import skimage.data
from PIL import Image

from tvm_qconv.data import (
    FULL_DECODE_RATIO,
    IMAGENET_MEAN,
    IMAGENET_STD,
    REDUCED_RATIO,
    load_image,
    preprocess,
    read_rgb,
    resize_short_side,
)
from tvm_qconv.errors import InputError

SIZE = 8
RED = (255, 0, 0)
# One uint8 step after normalization is 1/255/std <= 0.0175; lossless files must match to
# float32 rounding (resize and normalize of the same values: ~1e-6).
ATOL = 1e-5


def _red(mode_size=(SIZE, SIZE)) -> Image.Image:
    return Image.new("RGB", mode_size, RED)


def _palette_red() -> Image.Image:
    img = Image.new("P", (SIZE, SIZE), 0)
    img.putpalette([*RED, 0, 255, 0])
    return img


def _rgba_half_transparent() -> Image.Image:
    """Left half opaque red, right half fully transparent green (a viewer shows white there)."""
    rgba = np.zeros((SIZE, SIZE, 4), np.uint8)
    rgba[:, : SIZE // 2] = (*RED, 255)
    rgba[:, SIZE // 2:] = (0, 255, 0, 0)
    return Image.fromarray(rgba, "RGBA")


def _half_red_half_white() -> np.ndarray:
    rgb = np.full((SIZE, SIZE, 3), 255, np.uint8)
    rgb[:, : SIZE // 2] = RED
    return rgb


def _la() -> Image.Image:
    """Gray 100, alpha 0 on the left half and 255 on the right."""
    la = np.zeros((SIZE, SIZE, 2), np.uint8)
    la[..., 0] = 100
    la[:, SIZE // 2:, 1] = 255
    return Image.fromarray(la, "LA")


def _la_expected() -> np.ndarray:
    gray = np.full((SIZE, SIZE), 255, np.uint8)
    gray[:, SIZE // 2:] = 100
    return gray


def _palette_transparent() -> Image.Image:
    """Palette index 0 (red) opaque on the left, index 1 (green) transparent on the right."""
    img = _palette_red()
    img.paste(1, (SIZE // 2, 0, SIZE, SIZE))
    img.info["transparency"] = 1
    return img


def _palette_alpha() -> Image.Image:
    """Mode PA (palette + alpha): red opaque on the left, green transparent on the right."""
    img = _palette_transparent().convert("PA")
    alpha = np.zeros((SIZE, SIZE), np.uint8)
    alpha[:, : SIZE // 2] = 255
    img.putalpha(Image.fromarray(alpha))
    return img


def _gray16() -> Image.Image:
    values = np.full((SIZE, SIZE), 65535, np.uint16)
    values[:, SIZE // 2:] = 32768
    return Image.fromarray(values)  # mode I;16


def _gray16_expected() -> np.ndarray:
    out = np.ones((SIZE, SIZE), np.float32)
    out[:, SIZE // 2:] = 32768 / 65535
    return out


def _gray32() -> Image.Image:
    values = np.full((SIZE, SIZE), 65535, np.int32)
    values[:, SIZE // 2:] = 16384
    return Image.fromarray(values, "I")


def _gray32_expected() -> np.ndarray:
    out = np.ones((SIZE, SIZE), np.float32)
    out[:, SIZE // 2:] = 16384 / 65535
    return out


def _float_gray() -> Image.Image:
    return Image.fromarray(np.linspace(0, 1, SIZE * SIZE, dtype=np.float32).reshape(SIZE, SIZE), "F")


def _save(img, path, **kwargs):
    img.save(path, **kwargs)


def _gif_two_frames(path):
    red = _red().convert("P")
    blue = Image.new("RGB", (SIZE, SIZE), (0, 0, 255)).convert("P")
    red.save(path, save_all=True, append_images=[blue])


def _tiff_two_frames(path):
    _red().save(path, save_all=True, append_images=[Image.new("RGB", (SIZE, SIZE), (0, 0, 255))])


def _png16_rgb(path, rgb16: np.ndarray):
    """A 48-bit (16 bits per channel) RGB PNG, written by hand: Pillow cannot write one."""
    h, w, _ = rgb16.shape

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + rgb16[y].astype(">u2").tobytes() for y in range(h))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


RGB16 = np.zeros((SIZE, SIZE, 3), np.uint16)
RGB16[..., 0] = 65535
RGB16[..., 2] = 0x8000  # high byte 128
RED_U8 = np.full((SIZE, SIZE, 3), RED, np.uint8)
GRAY_U8 = np.full((SIZE, SIZE), 77, np.uint8)
BILEVEL = np.zeros((SIZE, SIZE), bool)
BILEVEL[::2] = True

# (file name, how to write it, the RGB / grayscale array a viewer shows): lossless files only.
LOSSLESS = [
    ("rgb.png", lambda p: _save(_red(), p), RED_U8),
    ("palette.png", lambda p: _save(_palette_red(), p), RED_U8),
    ("rgba_half.png", lambda p: _save(_rgba_half_transparent(), p), _half_red_half_white()),
    ("palette_transparent.png", lambda p: _save(_palette_transparent(), p), _half_red_half_white()),
    ("palette_alpha.tif", lambda p: _save(_palette_alpha(), p), _half_red_half_white()),
    ("la.png", lambda p: _save(_la(), p), _la_expected()),
    ("gray16.png", lambda p: _save(_gray16(), p), _gray16_expected()),
    ("gray16b.tif", lambda p: _save(_gray16().convert("I").convert("I;16B"), p), _gray16_expected()),
    ("gray32.tif", lambda p: _save(_gray32(), p), _gray32_expected()),
    ("gray8.png", lambda p: _save(Image.fromarray(GRAY_U8), p), GRAY_U8),
    ("bilevel.png", lambda p: _save(Image.fromarray(BILEVEL).convert("1"), p), BILEVEL.astype(np.uint8) * 255),
    ("float.tif", lambda p: _save(_float_gray(), p), np.asarray(_float_gray())),
    ("rgb48.png", lambda p: _png16_rgb(p, RGB16), (RGB16 >> 8).astype(np.uint8)),
    ("two_frames.gif", _gif_two_frames, RED_U8),
    ("two_frames.tif", _tiff_two_frames, RED_U8),
]
LOSSLESS_IDS = [name.replace(".", "_") for name, _, _ in LOSSLESS]

# Lossy or approximate conversions: red must stay red (R the highest channel, well above G and B).
RED_STAYS_RED = [
    ("cmyk.jpg", lambda p: _save(_red().convert("CMYK"), p, quality=95)),
    ("cmyk.tif", lambda p: _save(_red().convert("CMYK"), p)),
    ("ycbcr.tif", lambda p: _save(_red().convert("YCbCr"), p)),
    ("lab.tif", lambda p: _save(_red().convert("LAB"), p)),
]
RED_STAYS_RED_IDS = [name.replace(".", "_") for name, _ in RED_STAYS_RED]
RED_NORMALIZED = (np.array(RED) / 255 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)


@pytest.mark.parametrize("name, write, shown", LOSSLESS, ids=LOSSLESS_IDS)
def test_a_lossless_file_reads_as_the_rgb_a_viewer_shows(tmp_path, name, write, shown):
    path = tmp_path / name
    write(path)
    np.testing.assert_allclose(load_image(path, SIZE), preprocess(shown, SIZE), atol=ATOL)


@pytest.mark.parametrize("name, write", RED_STAYS_RED, ids=RED_STAYS_RED_IDS)
def test_red_stays_red_in_every_colour_mode(tmp_path, name, write):
    path = tmp_path / name
    write(path)
    if name.startswith("cmyk"):
        assert Image.open(path).mode == "CMYK"  # 4 channels: once taken as RGBA, red read as cyan
    if name.startswith("ycbcr"):
        assert Image.open(path).mode == "YCbCr"
    r, g, b = load_image(path, SIZE).mean(axis=(1, 2))
    assert r > g + 3 and r > b + 3, (r, g, b)  # red 2.25, green -2.04, blue -1.80 normalized
    # within 8 uint8 steps of pure red per channel (JPEG, and LAB's round trip: 251, 5, 4)
    np.testing.assert_allclose((r, g, b), RED_NORMALIZED, atol=8 / 255 / min(IMAGENET_STD))


def test_transparent_pixels_are_white_not_the_hidden_colour(tmp_path):
    path = tmp_path / "clear.png"
    Image.new("RGBA", (SIZE, SIZE), (0, 255, 0, 0)).save(path)
    white = (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(load_image(path, SIZE).mean(axis=(1, 2)), white, atol=ATOL)


def test_sixteen_bit_gray_is_scaled_by_65535_not_clipped(tmp_path):
    path = tmp_path / "g.png"
    Image.fromarray(np.full((SIZE, SIZE), 32768, np.uint16)).save(path)
    assert Image.open(path).mode == "I;16"
    half = (32768 / 65535 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(load_image(path, SIZE).mean(axis=(1, 2)), half, atol=ATOL)


BAD_VALUES = [
    ("float_above_one.tif", lambda p: Image.fromarray(np.full((SIZE, SIZE), 2.0, np.float32), "F").save(p),
     r"is float \(mode F\) with values from 2 to 2, outside \[0, 1\]"),
    ("float_nan.tif", lambda p: Image.fromarray(np.full((SIZE, SIZE), np.nan, np.float32), "F").save(p),
     r"outside \[0, 1\]"),
    ("int32_big.tif", lambda p: Image.fromarray(np.full((SIZE, SIZE), 70000, np.int32), "I").save(p),
     r"values from 70000 to 70000, outside the 16-bit range 0\.\.65535"),
    ("int32_negative.tif", lambda p: Image.fromarray(np.full((SIZE, SIZE), -1, np.int32), "I").save(p),
     r"outside the 16-bit range 0\.\.65535"),
]
BAD_VALUE_IDS = [name.split(".")[0] for name, _, _ in BAD_VALUES]


@pytest.mark.parametrize("name, write, says", BAD_VALUES, ids=BAD_VALUE_IDS)
def test_values_outside_the_modes_range_are_refused_in_one_line(tmp_path, name, write, says):
    path = tmp_path / name
    write(path)
    with pytest.raises(InputError, match=says) as err:
        load_image(path, SIZE)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


UNREADABLE = [
    ("garbage.png", b"\x89PNG not really"),
    ("truncated.png", None),
    ("empty.jpg", b""),
]
UNREADABLE_IDS = [name.split(".")[0] for name, _ in UNREADABLE]


@pytest.mark.parametrize("name, data", UNREADABLE, ids=UNREADABLE_IDS)
def test_an_unreadable_file_is_one_line(tmp_path, name, data):
    path = tmp_path / name
    if data is None:  # a real PNG cut in the middle of its pixel data
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)).save(path)
        path.write_bytes(path.read_bytes()[:200])
    else:
        path.write_bytes(data)
    with pytest.raises(InputError, match=r"cannot read image .*; give an image file \(JPEG, PNG") as err:
        load_image(path, SIZE)
    assert "\n" not in str(err.value)


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(InputError, match=r"cannot read image .*nope\.png: .*No such file"):
        load_image(tmp_path / "nope.png", SIZE)


def test_skimage_photos_still_load():
    assert load_image("skimage:coffee", SIZE).shape == (3, SIZE, SIZE)


# ---- huge images: decoded reduced, close to the whole decode (issue 56) --------------------------------------

HUGE_SIZE = 16     # resize short side 18: decoded whole up to 16 x 18 = 288 px, reduced beyond
HUGE_SHAPE = (900, 1200)


def _huge_photo() -> Image.Image:
    return Image.fromarray(skimage.data.astronaut()).resize(HUGE_SHAPE[::-1], Image.BICUBIC)


def _huge_rgba() -> Image.Image:
    # the right half transparent over green: a reduced decode must not let the hidden green in
    rgba = _huge_photo().convert("RGBA")
    rgba.paste((0, 255, 0, 0), (HUGE_SHAPE[1] // 2, 0, *HUGE_SHAPE[::-1]))
    return rgba


HUGE = [
    ("rgb.jpg", lambda p: _huge_photo().save(p, quality=90)),
    ("gray.jpg", lambda p: _huge_photo().convert("L").save(p, quality=90)),
    ("cmyk.jpg", lambda p: _huge_photo().convert("CMYK").save(p, quality=90)),
    ("rgb.png", lambda p: _huge_photo().save(p)),
    ("rgba_half.png", lambda p: _huge_rgba().save(p)),
    ("palette.gif", lambda p: _huge_photo().convert("P").save(p)),
    ("gray16.png", lambda p: Image.fromarray(np.asarray(_huge_photo().convert("L"), np.uint16) * 257).save(p)),
    ("bilevel.png", lambda p: _huge_photo().convert("1").save(p)),
]
HUGE_IDS = [name.replace(".", "_") for name, _ in HUGE]


def _in_255ths(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| of two preprocessed tensors in steps of an 8-bit pixel."""
    return np.abs(a - b) * np.asarray(IMAGENET_STD, np.float32)[:, None, None] * 255


@pytest.mark.parametrize("name, write", HUGE, ids=HUGE_IDS)
def test_a_huge_image_is_decoded_reduced_and_stays_close_to_the_whole_decode(tmp_path, name, write):
    path = tmp_path / name
    write(path)
    reduced = read_rgb(path, HUGE_SIZE)
    assert REDUCED_RATIO * resize_short_side(HUGE_SIZE) <= min(reduced.shape[:2]) < min(HUGE_SHAPE) // 4
    whole = preprocess(read_rgb(path), HUGE_SIZE)     # size None: decoded whole, as before issue 56
    diff = _in_255ths(load_image(path, HUGE_SIZE), whole)
    # measured 0.26-0.27 mean, 2.0 max for JPEG (decoded at 1/8: 113 px), 0.30-0.63 mean, 2.0-4.4
    # max for the others (box-reduced by 12: 75 px), from the reduction's average and a coarser linear
    # interpolation; resizing the reduced image on its own rounded-up grid gave 1.2 mean for JPEG
    assert diff.mean() < 1.0 and diff.max() < 8.0


def test_a_photo_up_to_16_times_the_resize_is_decoded_whole_bit_for_bit(tmp_path):
    short = FULL_DECODE_RATIO * resize_short_side(HUGE_SIZE)      # 288 px
    path = tmp_path / "edge.jpg"
    _huge_photo().resize((short * 4 // 3, short)).save(path, quality=90)
    assert read_rgb(path, HUGE_SIZE).shape == (short, short * 4 // 3, 3)
    with Image.open(path) as img:
        np.testing.assert_array_equal(load_image(path, HUGE_SIZE), preprocess(np.asarray(img), HUGE_SIZE))


def test_a_12000_px_jpeg_decodes_at_an_eighth_without_a_bomb_warning(tmp_path):
    # the photo of issue 56: 8 minutes and 4.2 GB to preprocess at 224 when decoded whole; at 1/8
    # (1500 x 1500, DCT scaling) about a second.  144 MP is over Pillow's 89 MP warning (not its
    # 179 MP refusal): read this way it asks nothing of the user.
    path = tmp_path / "huge.jpg"
    Image.linear_gradient("L").resize((12000, 12000)).save(path, quality=80)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_rgb(path, 224).shape == (1500, 1500)
        assert load_image(path, 224).shape == (3, 224, 224)


def test_a_decompression_bomb_is_one_line_saying_to_downscale(tmp_path, monkeypatch):
    # Pillow refuses over twice MAX_IMAGE_PIXELS (179 MP by default; 2000 px here to keep it small)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    _red((64, 64)).save(tmp_path / "bomb.png")
    with pytest.raises(InputError, match=r"bomb\.png is 4096 pixels, over the limit of 2000 pixels that guards "
                                         r"against decompression bombs .*: downscale it") as err:
        load_image(tmp_path / "bomb.png", SIZE)
    assert "\n" not in str(err.value)
