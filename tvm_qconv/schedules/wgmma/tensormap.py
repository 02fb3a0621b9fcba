"""The host half of TMA im2col: ``cuTensorMapEncodeIm2col`` as a TVM global function.

TVM 0.27 encodes tiled tensor maps itself (``T.tensormap_encode_tiled`` -> the runtime's
``cuTensorMapEncodeTiled``) but has no im2col encoder.  The wgmma conv's host code calls
:data:`ENCODE_IM2COL` (``T.call_packed``) before each launch to describe its NHWC input; this
module registers it, calling the CUDA driver through ctypes.  It must be imported in any process
that runs a library holding wgmma kernels: ``tvm_qconv.runtime`` and the build import it.
Under a CUDA graph the encode runs once, at capture (the map is a by-value kernel parameter).
"""
from __future__ import annotations

import ctypes

import tvm_ffi

ENCODE_IM2COL = "tvm_qconv.tensormap_encode_im2col"
_U8 = 0                # CU_TENSOR_MAP_DATA_TYPE_UINT8: the bit pattern of int8
_L2_PROMOTION_128B = 2
_driver: list = []


def _cuda():
    if not _driver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise RuntimeError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {err}") from None
        lib.cuTensorMapEncodeIm2col.restype = ctypes.c_int
        _driver.append(lib)
    return _driver[0]


def _pointer(handle) -> ctypes.c_void_p:
    if isinstance(handle, ctypes.c_void_p):
        return handle
    return ctypes.c_void_p(handle.value if hasattr(handle, "value") else int(handle))


@tvm_ffi.register_global_func(ENCODE_IM2COL, override=True)
def encode_im2col(tensor_map, data, n, h, w, c, lower_h, lower_w, upper_h, upper_w, channels, pixels,
                  stride_h, stride_w, swizzle) -> int:
    """Fill ``tensor_map`` (a 128-byte host slot) for the int8 NHWC tensor at ``data``.

    Each load then brings ``pixels`` output pixels x ``channels`` channels of one filter tap; the
    window of the first pixel starts at the coordinates the kernel passes, its tap at the offsets
    it passes; ``lower_*`` / ``upper_*`` are the corners of the box the windows' corners traverse
    (``-pad_before`` and ``pad_after - (kernel - 1) * dilation``) with the conv's strides.
    """
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
    dims = (u64 * 4)(c, w, h, n)
    byte_strides = (u64 * 3)(c, c * w, c * w * h)
    lower = (i32 * 2)(lower_w, lower_h)
    upper = (i32 * 2)(upper_w, upper_h)
    traversal = (u32 * 4)(1, stride_w, stride_h, 1)
    rc = _cuda().cuTensorMapEncodeIm2col(_pointer(tensor_map), _U8, 4, _pointer(data), dims, byte_strides,
                                         lower, upper, u32(channels), u32(pixels), traversal, 0, swizzle,
                                         _L2_PROMOTION_128B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeIm2col failed (CUresult {rc}) for an int8 NHWC tensor "
                           f"[{n}, {h}, {w}, {c}]: rebuild without the wgmma family (--family mma)")
    return 0
