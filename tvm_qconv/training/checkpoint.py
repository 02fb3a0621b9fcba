"""The checkpoint format of QAT training, written and read here only.

A checkpoint (``torch.save`` of a dict) holds:

* ``state_dict``: the float-model state dict (no range buffers), so it loads strictly into the
  plain float model (``models.vgg.SmallVGG``; ``torchvision.models.vgg16`` for a VGG16 trained
  at 224x224, whose classifier is torchvision's);
* ``amax``: the learned ranges by calibration point, ``f"{layer}.in0"`` (input max|x|) and
  ``f"{layer}.out"`` (output max, after the fused ReLU) for every conv and linear layer, ``layer``
  being the module path (``"features.0"``);
* ``config``: :class:`TrainConfig` as a dict; ``accuracy``: test accuracies in percent.

:func:`tvm_qconv.build.compile_checkpoint` (``deploy.py build --checkpoint``) compiles a QAT
checkpoint with these ranges instead of calibration.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from ..fileio import atomic_path, file_kind
from ..nn import learned_amax, load_float_state_dict, to_float_state_dict
from ..nn.modules import AMAX_BUFFERS, TRACKED_LAYERS
from .config import DIGITS_CLASSES, TrainConfig, build_model

__all__ = ["DIGITS_CLASSES", "save_checkpoint", "read_checkpoint", "load_checkpoint", "load_float_model",
           "set_learned_amax"]


def save_checkpoint(path: str, model: nn.Module, config: TrainConfig, accuracy: dict[str, float]) -> dict:
    """Write the checkpoint dict (module docstring) atomically: a temp file renamed into place.

    Returns:
        The dict written.
    """
    ckpt = {
        "state_dict": to_float_state_dict(model.state_dict()),
        "amax": learned_amax(model),
        "config": config.to_dict(),
        "accuracy": dict(accuracy),
    }
    # A file object: torch names the archive after a path's stem, and the temporary's starts with ".".
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(ckpt, f)
    return ckpt


def set_learned_amax(model: nn.Module, amax: dict[str, float]) -> None:
    """Restore the range buffers from a checkpoint's ``amax`` dict.

    Raises:
        KeyError: a tracked layer of ``model`` has no entry.
    """
    for name, m in model.named_modules():
        if isinstance(m, TRACKED_LAYERS):
            for buf, suffix in AMAX_BUFFERS.items():
                getattr(m, buf).fill_(float(amax[f"{name}.{suffix}"]))


CHECKPOINT_KEYS = ("state_dict", "amax", "config")


def read_checkpoint(path: str) -> tuple[dict, TrainConfig]:
    """Read and check a file written by :func:`save_checkpoint`.

    Returns:
        ``(checkpoint dict, its TrainConfig)``.

    Raises:
        InputError: unreadable, not a dict with ``state_dict`` / ``amax`` / ``config`` (e.g. a
            plain state dict), or a config this version cannot read.
    """
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"checkpoint {path} not found: give the file `python train.py --qat --out CKPT` "
                         "wrote") from None
    except Exception as err:
        kind = file_kind(path)
        if kind is not None and kind != "a file torch.save wrote":   # a file of another kind in this slot
            raise InputError(f"{path} is {kind}, not a checkpoint: give the file `python train.py --qat --out CKPT` "
                             "wrote") from None
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise InputError(f"cannot read checkpoint {path}: {type(err).__name__}: {reason}") from err
    lacking = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if lacking:
        what = f"a dict with keys {sorted(ckpt)[:6]}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise InputError(f"{path} is not a train.py checkpoint ({what}; it lacks {lacking}): give the file that "
                         "`python train.py --qat --out CKPT` wrote; a plain state dict of a torchvision model "
                         "builds with --model NAME --weights FILE (ranges by calibration)")
    try:
        config = TrainConfig.from_dict(dict(ckpt["config"]))
    except (TypeError, ValueError) as err:
        raise InputError(f"checkpoint {path} has a training config this version cannot read: {err}") from err
    return ckpt, config


def not_a_checkpoint(path: str) -> str | None:
    """Why the file at ``path`` is not a checkpoint :func:`save_checkpoint` wrote, or None: what
    ``train.py --out`` replaces only with ``--force``."""
    try:
        read_checkpoint(path)
    except InputError:
        return "not a train.py checkpoint"
    return None


def load_checkpoint(path: str, quantized: bool | None = None) -> tuple[nn.Module, dict]:
    """Rebuild the trained model of a checkpoint, with its weights and learned ranges, in eval mode.

    Args:
        path: a file written by :func:`save_checkpoint`.
        quantized: build the int8 model (True) or the float twin (False); default: as trained.

    Returns:
        ``(model, checkpoint dict)``.
    """
    ckpt, config = read_checkpoint(path)
    model = build_model(config, quantized)
    load_float_state_dict(model, ckpt["state_dict"])
    set_learned_amax(model, ckpt["amax"])
    return model.eval(), ckpt


def load_float_model(path: str, require_qat: bool = False) -> tuple[nn.Module, dict, TrainConfig]:
    """The float architecture a checkpoint was trained with, holding its weights, in eval mode.

    This is what the compile step imports: the float twin (``TorchConv2dReLU``, ...) has the
    trained model's module names, so its calibration points are the checkpoint's ``amax`` keys.

    Args:
        path: a file written by :func:`save_checkpoint`.
        require_qat: raise unless the checkpoint was trained with ``qat=True``.

    Returns:
        ``(model, checkpoint dict, TrainConfig)``.

    Raises:
        InputError: see :func:`read_checkpoint`; trained in float while ``require_qat``; weights
            that do not fit the configured model.
    """
    ckpt, config = read_checkpoint(path)
    if require_qat and not config.qat:
        raise InputError(f"{path} was trained in float (train.py without --qat): its ranges are statistics of the "
                         "float activations, not scales learned under int8; retrain with "
                         f"`python train.py --model {config.model} --qat --out CKPT`")
    model = build_model(config, quantized=False)
    try:
        load_float_state_dict(model, ckpt["state_dict"])
    except RuntimeError as err:
        raise InputError(f"the weights in {path} do not fit its configured model {config.model}: {err}") from err
    return model.eval(), ckpt, config
