"""float32 arithmetic as IEEE rounds it, whatever TVM's ``--use_fast_math`` does to CUDA's operators
(``elementwise.py``'s module docstring says what it does and why each kernel must not feel it).

One definition for every training kernel that computes a float32 ``a op b`` -- ``elementwise``'s
computes, the written kernels (``dequantize_amax``, ``relu_bits_amax``) and the per-channel ones
(``bn_channel``, ``quant_scales``) -- so they agree bit for bit with each other and with torch.
"""
from __future__ import annotations

from tvm import tirx

OPS = {"*": lambda p, q: p * q, "/": lambda p, q: p / q, "+": lambda p, q: p + q, "-": lambda p, q: p - q}
# CUDA's correctly rounded float32 operations: IEEE whatever --use_fast_math says (it makes ``/``
# approximate and contracts ``a * b + c``), and off the float64 pipe (conversions and a software
# division per element), which had bounded the quantizing kernels on an H200
RN = {"*": "__fmul_rn", "/": "__fdiv_rn", "+": "__fadd_rn", "-": "__fsub_rn"}


def exact(op: str, a, b, rn: bool = False):
    """float32 ``a op b`` for float32 operands, as IEEE float32 arithmetic gives it: CUDA's
    ``__f*_rn`` intrinsics where ``rn``, else in float64 rounded once (exact for ``+``, ``*`` and
    ``/``: 53 >= 2 * 24 + 2 bits, no double-rounding error)."""
    if rn:
        return tirx.call_pure_extern("float32", RN[op], a, b)
    return OPS[op](a.astype("float64"), b.astype("float64")).astype("float32")
