"""Facts about reading image files of every Pillow mode (``tvm_qconv.data.load_image``): each
becomes the RGB image a viewer shows, then the same tensor ``preprocess`` makes of that RGB array."""
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tvm_qconv.data import IMAGENET_MEAN, IMAGENET_STD, load_image, preprocess
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
    with pytest.raises(InputError, match=r"cannot read image .*; give a JPEG or PNG file") as err:
        load_image(path, SIZE)
    assert "\n" not in str(err.value)


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(InputError, match=r"cannot read image .*nope\.png: .*No such file"):
        load_image(tmp_path / "nope.png", SIZE)


def test_skimage_photos_still_load():
    assert load_image("skimage:coffee", SIZE).shape == (3, SIZE, SIZE)
