"""Where a model's int8 error comes from, in PyTorch alone: weights, activations, or both.

    python benchmarks/quant_noise_split.py --model mobilenet_v2 --weights mobilenet_v2-b0353104.pth --out results/

The compiler's scheme simulated in float (no TVM): BatchNorm folded into the convs, then
(a) every conv / linear weight rounded to int8 per output channel; (b) every activation the int8
model keeps (the input, each ReLU / ReLU6 output, each block output) rounded to int8 per tensor at
the ``--percentile`` of |x| on the calibration photos; (c) both; and (a), (c) again with bias
correction (each layer's bias minus the mean error its rounded weights add, ``E[conv(x, W_q - W)]``
over the calibration photos).  Logits SQNR and top-1 agreement against the float model, on the
photos the ranges were not taken from.  A model whose (c) matches the compiled library's SQNR
shows the compiler adds nothing to the scheme's own error; (a) alone bounds what any activation
observer can reach.  Calibration photos: ``--calib first|last`` (scikit-image's first 8 are objects,
the last 7 textures).  Writes ``<out>/quant_noise_split_<model>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.evaluate import sqnr_db  # noqa: E402
from tvm_qconv.frontend import load_model  # noqa: E402


def fake_quant(x: torch.Tensor, amax) -> torch.Tensor:
    s = amax / 127
    return torch.clamp(torch.round(x / s), -127, 127) * s


def fold_batch_norms(model: nn.Module) -> nn.Module:
    """Each BatchNorm that follows a conv (module order) folded into it, left as the identity."""
    mods = list(model.modules())
    for conv, bn in zip(mods, mods[1:]):
        if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            g = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
            bias = conv.bias.detach() if conv.bias is not None else torch.zeros_like(bn.running_mean)
            conv.weight.data = conv.weight.detach() * g[:, None, None, None]
            conv.bias = nn.Parameter((bias - bn.running_mean) * g + bn.bias.detach())
            bn.weight.data.fill_(1.0)
            bn.bias.data.zero_()
            bn.running_mean.zero_()
            bn.running_var.fill_(1.0 - bn.eps)
    return model


def quantize_weights(model: nn.Module, calib: torch.Tensor, bias_correction: bool) -> None:
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    inputs: dict = {}
    if bias_correction:  # the float model's inputs of every layer on the calibration photos
        hooks = [m.register_forward_hook(lambda mod, i, o: inputs.__setitem__(id(mod), i[0].detach())) for m in layers]
        with torch.no_grad():
            model(calib)
        for h in hooks:
            h.remove()
    for m in layers:
        w = m.weight.detach()
        wq = fake_quant(w, w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True).clamp_min(1e-30))
        if bias_correction:
            x = inputs[id(m)]
            with torch.no_grad():
                err = (F.conv2d(x, wq - w, None, m.stride, m.padding, m.dilation, m.groups).mean((0, 2, 3))
                       if isinstance(m, nn.Conv2d) else F.linear(x, wq - w).mean(0))
            if m.bias is None:
                m.bias = nn.Parameter(torch.zeros(w.shape[0]))
            m.bias.data -= err
        m.weight.data = wq


KEEP_FLOAT: tuple[str, ...] = ()  # activations (module names) left in float: --keep-float


def activation_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose outputs the int8 model keeps in int8: activations and residual blocks
    (less those named in ``KEEP_FLOAT``)."""
    acts = [m for m in model.modules() if isinstance(m, (nn.ReLU, nn.ReLU6))]
    blocks = [m for m in model.modules() if type(m).__name__ in ("InvertedResidual", "BasicBlock", "Bottleneck")]
    projects = [b.conv[-1] for b in blocks if hasattr(b, "conv")]  # MobileNet-V2's linear bottleneck output
    names = {id(m): n for n, m in model.named_modules()}
    return [m for m in acts + blocks + projects if names[id(m)] not in KEEP_FLOAT]


def quantize_activations(model: nn.Module, calib: torch.Tensor, percentile: float, only: int | None = None):
    """Hooks rounding each kept activation (``only``: just the one of that index) to int8 at its
    calibrated range; returns the input's range."""
    mods = activation_modules(model)
    if only is not None:
        mods = [mods[only]]
    seen: dict = {id(m): [] for m in mods}
    hooks = [m.register_forward_hook(lambda mod, i, o: seen[id(mod)].append(o.detach().abs().flatten())) for m in mods]
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()
    amax = {k: float(np.percentile(torch.cat(v).numpy(), percentile)) for k, v in seen.items()}
    names = {id(m): n for n, m in model.named_modules()}
    for m in mods:
        m.register_forward_hook(_rounding_hook(amax[id(m)], names[id(m)] if only is not None else None))
    return float(np.percentile(calib.abs().numpy(), percentile))


OWN_ENERGY: dict = {}  # module name -> [signal, noise]: its int8 output against its float one (--per-tensor)


def _rounding_hook(amax: float, name: str | None = None):
    """Round the module's output to int8 at ``amax``; with ``name``, add up its rounding's
    signal and noise over every call (a module may be called several times per forward, e.g.
    ResNet's shared ReLU)."""
    def hook(mod, i, o):
        q = fake_quant(o, amax)
        if name is not None:
            energy = OWN_ENERGY.setdefault(name, [0.0, 0.0])
            energy[0] += float((o.double() ** 2).sum())
            energy[1] += float(((q - o).double() ** 2).sum())
        return q
    return hook


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--weights", required=True, help="state-dict file (trained weights: the point of this script)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--calib", choices=["first", "last"], default="last",
                    help="calibrate on scikit-image's first 8 photos (objects) or last 7 (textures)")
    ap.add_argument("--eval-on-calib", action="store_true",
                    help="measure on the calibration photos themselves (no range mismatch: rounding and "
                         "percentile clipping only)")
    ap.add_argument("--percentile", type=float, default=99.99)
    ap.add_argument("--per-tensor", action="store_true", help="also each kept activation alone in int8")
    ap.add_argument("--keep-float", nargs="+", default=[], metavar="MODULE",
                    help="leave these activations (module names, e.g. features.15.conv.1.2) in float")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    global KEEP_FLOAT
    KEEP_FLOAT = tuple(args.keep_float)
    photos = torch.from_numpy(skimage_photos(args.size))
    calib, held = (photos[:8], photos[8:]) if args.calib == "first" else (photos[8:], photos[:8])
    if args.eval_on_calib:
        held = calib

    def fresh():
        return fold_batch_norms(load_model(args.model, args.weights).eval())

    with torch.no_grad():
        ref = fresh()(held).numpy()
    rows = []
    for name, weights, acts, bc in [("weights int8", True, False, False), ("activations int8", False, True, False),
                                    ("both", True, True, False), ("weights int8, bias corrected", True, False, True),
                                    ("both, bias corrected", True, True, True)]:
        model = fresh()
        if weights:
            quantize_weights(model, calib, bc)
        x = held
        if acts:
            x = fake_quant(held, quantize_activations(model, calib, args.percentile))
        with torch.no_grad():
            y = model(x).numpy()
        rows.append(dict(case=name, sqnr_db=round(sqnr_db(ref, y), 2), top1_agree=float((ref.argmax(1) == y.argmax(1)).mean())))
        print(f"{name:>30}: {rows[-1]['sqnr_db']:6.2f} dB, top-1 {rows[-1]['top1_agree']:.0%}", flush=True)
    if args.per_tensor:  # each kept activation alone in int8: which ones the error is made of
        probe = fresh()
        names = {id(m): n for n, m in probe.named_modules()}
        labels = [names[id(m)] for m in activation_modules(probe)]
        alone = []
        for i, label in enumerate(labels):
            model = fresh()
            quantize_activations(model, calib, args.percentile, only=i)
            OWN_ENERGY.clear()
            with torch.no_grad():
                logits = sqnr_db(ref, model(held).numpy())
            # own: the tensor's int8 rounding against its float value; the logits' SQNR below it
            # is how much the rest of the network amplifies that noise
            signal, noise = OWN_ENERGY[label]
            alone.append(dict(tensor=label, sqnr_db=round(logits, 2),
                              own_sqnr_db=round(10 * np.log10(signal / noise), 2) if noise else float("inf")))
        alone.sort(key=lambda r: r["sqnr_db"])
        rows.append(dict(case="each activation alone in int8 (worst first)", tensors=alone))
        for r in alone[:12]:
            print(f"{r['tensor']:>30} alone: logits {r['sqnr_db']:6.2f} dB (the tensor itself {r['own_sqnr_db']:6.2f} dB)",
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="python " + " ".join(sys.argv),
               model=args.model, weights=os.path.basename(args.weights), size=args.size, calib=args.calib,
               keep_float=list(args.keep_float), eval_on_calib=args.eval_on_calib,
               percentile=args.percentile, rows=rows)
    tag = ("_keep_float" if args.keep_float else "") + ("_eval_on_calib" if args.eval_on_calib else "")
    with open(os.path.join(args.out, f"quant_noise_split_{args.model}{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
