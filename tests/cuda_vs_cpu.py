"""A model's CUDA build against its CPU build, int8 activation by int8 activation (GPU tests)."""
import numpy as np

from tvm_qconv import registry
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.ranges import Calibrate
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.target import device_arch


def assert_cuda_build_equals_cpu_build(model, photos, size: int, tmp_path, batch: int = 2) -> list[str]:
    """Build ``model`` for llvm and for this GPU (batch ``batch``, calibrated on ``photos[:4]``), run both
    on ``photos[4:4 + batch]`` and assert every exposed int8 activation equal, integer for integer (each
    unpacked from its own layout); returns the CUDA build's layer names."""
    outs, exposed = {}, {}
    for target in ("llvm", "cuda"):
        res = compile_model(model, str(tmp_path / f"{target}.so"), config=QuantConfig(num_calib_images=4),
                            options=BuildOptions(target=target, arch=device_arch() if target == "cuda" else None,
                                                 batch=batch, image_size=size, expose_activations=True),
                            ranges=Calibrate(photos[:4]), progress=False)
        outs[target] = CompiledModel(res.lib_path).outputs(photos[4:4 + batch])
        exposed[target] = res.report["exposed"]
    for e_cpu, e_gpu, a, b in zip(exposed["llvm"], exposed["cuda"], outs["llvm"][1:], outs["cuda"][1:]):
        np.testing.assert_array_equal(registry.layout(e_cpu["layout"]).unpack(a, e_cpu["channels"]),
                                      registry.layout(e_gpu["layout"]).unpack(b, e_gpu["channels"]), e_cpu["layer"])
    return [e["layer"] for e in exposed["cuda"]]
