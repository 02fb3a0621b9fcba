"""The functions that compiled kernels call at run time, and the families whose kernels call them.

A kernel's host code may call a TVM global function the project defines (``T.call_packed``): the
wgmma family's calls ``tvm_qconv.tensormap_encode_im2col`` before each launch to describe its
input to TMA (``wgmma/tensormap.py``).  Every process that runs such a library registers them
here -- ``tvm_qconv.runtime``, the RPC server, the tuner's runner workers, the training kernels --
with :func:`register`, and a client asks :func:`called_by` what a library needs of a server; so
none of them names a family.

Importing this module registers them too (each family's module registers its own when imported,
as every process that imports its kernels needs: a build runs its library to verify it).  It
imports no kernel: the registry (``tvm_qconv/registry.py``) imports every one, ~0.3 s that
``import tvm_qconv.runtime`` does not pay.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi

from .wgmma import tensormap


@dataclass(frozen=True)
class RuntimeFunction:
    """A global function that kernels call at run time.

    Attributes:
        name: its TVM global name.
        function: what is registered under it.
        family: the family whose kernels call it (their implementation names hold ``.<family>``).
        instead: a family that computes the same layers without it (a rebuild's ``--family``).
    """

    name: str
    function: object
    family: str
    instead: str


FUNCTIONS: tuple[RuntimeFunction, ...] = (
    RuntimeFunction(tensormap.ENCODE_IM2COL, tensormap.encode_im2col, "wgmma", "mma"),
)


def register() -> None:
    """Register every runtime function in this process (again, where importing this module did:
    the same function under the same name)."""
    for f in FUNCTIONS:
        tvm_ffi.register_global_func(f.name, f.function, override=True)


def called_by(kernels) -> list[RuntimeFunction]:
    """The runtime functions a library calls whose layers ran ``kernels`` (implementation names,
    as its build report lists them)."""
    return [f for f in FUNCTIONS if any(f".{f.family}" in k for k in kernels)]
