"""Facts about image preprocessing and the calibration / evaluation data sets."""
import numpy as np
import pytest
import skimage.io
from PIL import Image

from tvm_qconv.data import (
    IMAGE_SUFFIXES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    SKIMAGE_PHOTOS,
    digits_dataset,
    load_calibration_images,
    load_image,
    preprocess,
    skimage_photos,
)
from tvm_qconv.errors import InputError

RNG = np.random.default_rng(0)
IMAGES = [
    RNG.integers(0, 256, (40, 60), dtype=np.uint8),
    RNG.integers(0, 256, (60, 40, 3), dtype=np.uint8),
    RNG.integers(0, 256, (50, 50, 4), dtype=np.uint8),
    RNG.random((30, 70, 3), dtype=np.float32),
    RNG.random((30, 70, 1)),
]
IMAGE_IDS = ["gray-u8", "rgb-u8-tall", "rgba-u8", "rgb-f32-wide", "gray-f64-hw1"]
SIZES = [32, 224]
BAD_SHAPES = [(4,), (4, 4, 5), (2, 4, 4, 3), (0, 5, 3)]
BAD_SHAPE_IDS = ["1d", "5ch", "4d", "empty"]


@pytest.mark.parametrize("size", SIZES, ids=[f"s{s}" for s in SIZES])
@pytest.mark.parametrize("img", IMAGES, ids=IMAGE_IDS)
def test_preprocess_shape_and_dtype(img, size):
    out = preprocess(img, size)
    assert out.shape == (3, size, size) and out.dtype == np.float32
    assert out.flags.c_contiguous


def test_mean_color_becomes_zero():
    float_img = np.broadcast_to(np.float32(IMAGENET_MEAN), (50, 80, 3))
    # Exact mean color: only float32 rounding in resize/normalize (~1e-6).
    np.testing.assert_allclose(preprocess(float_img, 32), 0.0, atol=1e-5)
    u8_img = np.broadcast_to(np.round(np.array(IMAGENET_MEAN) * 255).astype(np.uint8), (50, 80, 3))
    # uint8 rounding of the mean moves it by <= 0.5/255, i.e. <= 0.5/255/0.224 ~ 0.0088.
    np.testing.assert_allclose(preprocess(u8_img, 32), 0.0, atol=0.5 / 255 / min(IMAGENET_STD))


def test_grayscale_is_replicated_to_three_channels():
    gray = np.full((40, 40), 0.5, np.float32)
    out = preprocess(gray, 16)
    expected = (0.5 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(out.mean(axis=(1, 2)), expected, atol=1e-5)


def test_center_crop_keeps_the_middle_of_a_wide_image():
    # Horizontal ramp 0..1 across a 2:1 image: the crop is centered, so it is symmetric
    # about 0.5 and (short side 256 of 224) spans the middle 224/512 of the width.
    ramp = np.tile(np.linspace(0, 1, 400, dtype=np.float32), (200, 1))
    out = preprocess(ramp, 224)[0] * IMAGENET_STD[0] + IMAGENET_MEAN[0]  # back to [0, 1]
    row = out[112]
    assert abs(row.mean() - 0.5) < 1e-3
    # Crop spans [0.5 - 112/512, 0.5 + 112/512] = [0.281, 0.719]; 0.01 allows edge pixels.
    assert abs(row[0] - 0.281) < 0.01 and abs(row[-1] - 0.719) < 0.01


@pytest.mark.parametrize("shape", BAD_SHAPES, ids=BAD_SHAPE_IDS)
def test_preprocess_rejects_non_images(shape):
    with pytest.raises(InputError, match="expected an HxW"):
        preprocess(np.zeros(shape, np.uint8), 8)


def test_load_image_matches_preprocess(tmp_path):
    img = RNG.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    skimage.io.imsave(tmp_path / "a.png", img, check_contrast=False)
    np.testing.assert_array_equal(load_image(tmp_path / "a.png", 32), preprocess(img, 32))


def test_unreadable_image_raises_input_error(tmp_path):
    bad = tmp_path / "x.jpg"
    bad.write_bytes(b"this is not a jpeg \x00\x01\x02")
    expected = r"(?s)cannot read image .*x\.jpg: .*; give an image file \(JPEG, PNG, BMP, WebP, GIF, TIFF\)"
    with pytest.raises(InputError, match=expected):
        load_image(bad, 32)


def make_folder(tmp_path):
    # Written out of name order; brightness 40, 80, 120 follows name order a, b, c.
    for name, value in [("c.jpeg", 120), ("a.PNG", 40), ("b.png", 80)]:
        img = np.full((20, 30, 3), value, np.uint8)
        skimage.io.imsave(tmp_path / name, img, check_contrast=False)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "sub.png").mkdir()  # a folder named like an image is not an image
    return tmp_path


def test_calibration_folder_sorted_by_name_case_insensitive_suffix(tmp_path):
    x = load_calibration_images(make_folder(tmp_path), 16)
    assert x.shape == (3, 3, 16, 16) and x.dtype == np.float32
    # Name order a.PNG (40), b.png (80), c.jpeg (120, JPEG-lossy): increasing brightness.
    means = x.mean(axis=(1, 2, 3))
    assert means[0] < means[1] < means[2]


def test_calibration_folder_limit(tmp_path):
    x = load_calibration_images(make_folder(tmp_path), 16, limit=2)
    assert x.shape == (2, 3, 16, 16)


def test_empty_calibration_folder(tmp_path):
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(InputError,
                       match=r"no images \(.jpg, .jpeg, .png, .bmp, .webp, .gif, .tif, .tiff\) in calibration"):
        load_calibration_images(tmp_path, 16)


def test_missing_calibration_folder(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_calibration_images(tmp_path / "nope", 16)


def test_bad_limit(tmp_path):
    with pytest.raises(InputError, match="limit"):
        load_calibration_images(None, 16, limit=0)


def test_skimage_photos_are_distinct_real_photos():
    photos = skimage_photos(32)
    assert photos.shape[1:] == (3, 32, 32) and photos.dtype == np.float32
    assert 3 <= len(photos) <= len(SKIMAGE_PHOTOS)
    # Distinct content: every pair differs by a mean |delta| of > 0.1 normalized units.
    flat = photos.reshape(len(photos), -1)
    diffs = np.abs(flat[:, None] - flat[None]).mean(axis=2)
    assert (diffs[~np.eye(len(photos), dtype=bool)] > 0.1).all()
    # Real photos have texture: not near-constant images.
    assert (flat.std(axis=1) > 0.1).all()


def test_skimage_photos_returns_a_fresh_copy():
    a = skimage_photos(32)
    a[:] = 0
    assert np.abs(skimage_photos(32)).sum() > 0


def test_calibration_default_uses_skimage_photos():
    x = load_calibration_images(None, 32, limit=4)
    np.testing.assert_array_equal(x, skimage_photos(32)[:4])


def test_digits_dataset():
    (x_train, y_train), (x_test, y_test) = digits_dataset(size=32, seed=0)
    assert x_train.shape == (1437, 3, 32, 32) and x_test.shape == (360, 3, 32, 32)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert set(np.unique(y_test)) == set(range(10))
    # (x - 0.5) / 0.5 of [0, 1] pixels: exactly [-1, 1]; background pixels are -1.
    assert x_train.min() == -1.0 and x_train.max() == 1.0
    # Grayscale replicated: the three channels are identical.
    np.testing.assert_array_equal(x_train[:, 0], x_train[:, 2])
    # Stratified: each class's test share is within 1 sample of 20%.
    counts_all = np.bincount(np.concatenate([y_train, y_test]), minlength=10)
    assert (np.abs(np.bincount(y_test, minlength=10) - 0.2 * counts_all) <= 1).all()


def test_digits_dataset_upsampling_is_block_copy_for_multiples_of_8():
    (x16, _), _ = digits_dataset(size=16, seed=1)
    (x8, _), _ = digits_dataset(size=8, seed=1)
    np.testing.assert_array_equal(x16[:, :, ::2, ::2], x8)
    np.testing.assert_array_equal(x16[:, :, 1::2, 1::2], x8)


# ---- --calib-dir reads what `eval --data` reads (issue 56) --------------------------------------------------

CALIB_FORMATS = (".bmp", ".webp", ".gif", ".tif", ".tiff", ".JPG", ".png")
TINY_MODEL = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 5))
'''


def test_calibration_reads_every_format_eval_reads(tmp_path):
    from tvm_qconv.labelled_images import SUFFIXES
    assert SUFFIXES == IMAGE_SUFFIXES and all(s.lower() in IMAGE_SUFFIXES for s in CALIB_FORMATS)
    for i, suffix in enumerate(CALIB_FORMATS):
        Image.fromarray(np.full((20, 30, 3), 30 * i, np.uint8)).save(tmp_path / f"{i}{suffix}")
    x = load_calibration_images(tmp_path, 16)
    # one image per format, in name order: the brightness rises with the name
    assert x.shape == (len(CALIB_FORMATS), 3, 16, 16) and (np.diff(x.mean(axis=(1, 2, 3))) > 0).all()


def test_an_unreadable_calibration_file_is_left_out_and_named_from_the_cli(tmp_path, capsys):
    # a folder of BMP / WebP / TIFF photos (left out by --calib-dir until issue 56) and one broken
    # JPEG: the build calibrates on the three that read, and a warning names the broken one
    import deploy   # (TVM and torch: only this test of the file needs them)
    from tvm_qconv.runtime.artifact import read_meta
    (tmp_path / "models.py").write_text(TINY_MODEL)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, suffix in enumerate((".bmp", ".webp", ".tif")):
        Image.fromarray(RNG.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(calib / f"{i}{suffix}")
    (calib / "3_broken.jpg").write_bytes(b"\xff\xd8 cut short")
    lib = tmp_path / "m.so"
    argv = ["build", "--model", f"{tmp_path / 'models.py'}:make", "--image-size", "16", "--calib-dir", str(calib),
            "--no-verify", "-o", str(lib), "--quiet"]
    assert deploy.main(argv) == 0
    broken, few = capsys.readouterr().err.strip().split("\n")     # one line each
    assert broken.startswith("warning: calibration folder") and "3_broken.jpg" in broken
    # three images are fewer than the percentile observer should have (config.CALIBRATION_IMAGES)
    assert few.startswith("warning: calibrating on 3 images of") and "should have 8 or more" in few
    ranges = read_meta(str(lib))["report"]["ranges"]
    assert ranges["images"] == 3 and [s["file"] for s in ranges["skipped"]] == [str(calib / "3_broken.jpg")]
    assert "should have 8 or more" in ranges["too_few"]


@pytest.mark.parametrize("flags, images, needed", [(["--calibration", "search"], 3, 4),
                                                    (["--weight-rounding", "gptq"], 2, 4)])
def test_a_calibration_folder_too_small_for_the_method_is_refused_with_the_number_it_needs(tmp_path, capsys, flags,
                                                                                          images, needed):
    import deploy
    (tmp_path / "models.py").write_text(TINY_MODEL)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(images):
        Image.fromarray(RNG.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(calib / f"{i}.png")
    argv = ["build", "--model", f"{tmp_path / 'models.py'}:make", "--image-size", "16", "--calib-dir", str(calib),
            "--no-verify", "-o", str(tmp_path / "m.so"), "--quiet", *flags]
    assert deploy.main(argv) == 2
    err = capsys.readouterr().err
    assert f"needs at least {needed} calibration images, {calib} gave {images}" in err
    assert not (tmp_path / "m.so").exists()


def test_a_calibration_folder_of_no_readable_image_is_one_line(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(InputError, match=r"none of the 1 image files of calibration folder .*: cannot read image"):
        load_calibration_images(tmp_path, 16)
