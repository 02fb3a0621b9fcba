"""The CUDA source of a cross-compiled build, compiled by nvcc at build time.

A TVM without a CUDA runtime (PyPI's wheel, a CPU build machine) cannot compile a CUDA library's
kernels: ``tvm.compile`` keeps their CUDA C in the library, and the GPU machine's TVM compiles it
when it loads the library.  A kernel that nvcc rejects (TVM's codegen printing what nvcc does not
take: ``schedules/tensorcore/pipeline.py``, ``qconv.PrintableInt8Vectors``) would then fail on the
user's GPU, after a build that said it succeeded.  Where nvcc is on this machine, :func:`check`
compiles the source here, for the build's arch, so that such a build fails where it is made.
A TVM with a CUDA runtime compiles the kernels in ``tvm.compile`` already: nothing to do.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time

import tvm

from .target import cuda_source

NVCC_TIMEOUT_S = 900  # DeepLabV3 at 512 px: 13 s here; a library of many large kernels takes minutes


class RejectedSource(RuntimeError):
    """nvcc rejected a build's CUDA source: a bug of the project's kernels or of TVM's codegen
    (not a bad input: the CLI reports it as an internal failure, exit 1)."""


def tvm_compiles_cuda() -> bool:
    """Whether this TVM compiles CUDA kernels itself (it has the CUDA runtime, which registers the
    loader of compiled CUDA modules)."""
    return tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None


def check(ex, arch: str) -> dict:
    """Compile the CUDA source of ``ex`` (a ``tvm.compile`` result for ``arch``) with nvcc.

    Returns:
        the build report's ``cuda_source`` entry: ``{"status": "compiled by nvcc", "arch",
        "seconds"}``, or ``{"status": "compiled by TVM"}`` / ``{"status": "not checked", "reason"}``.

    Raises:
        RejectedSource: nvcc's error count and first error, and where the source was kept.
    """
    if tvm_compiles_cuda():
        return dict(status="compiled by TVM")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return dict(status="not checked", reason="this TVM has no CUDA runtime and this machine no nvcc: the GPU "
                                                 "machine compiles the source when it loads the library")
    source = cuda_source(ex)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tvm_qconv-nvcc-") as tmp:
        cu = os.path.join(tmp, "kernels.cu")
        with open(cu, "w") as f:
            f.write(source)
        # -diag-suppress 177: TVM declares helpers it does not always call ("declared but never referenced")
        done = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-o", os.path.join(tmp, "kernels.cubin"), cu,
                               "-diag-suppress", "177"], capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        # nvcc names the file by its path: by its name here, the temporary folder being gone
        errors = [line.replace(tmp + os.sep, "") for line in done.stderr.splitlines() if re.search(r"\berror\b", line)]
    if done.returncode != 0:
        fd, kept = tempfile.mkstemp(prefix="tvm_qconv-rejected-", suffix=".cu")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        first = (errors or done.stderr.strip().splitlines() or ["(no message)"])[0].strip()
        raise RejectedSource(f"nvcc rejects the CUDA source this build generated for {arch} ({len(errors)} "
                             f"error(s); first: {first[:200]}); it is kept in {kept}: this is a bug of tvm_qconv "
                             "(its kernels or TVM's codegen), not of your model: please report it with that file")
    return dict(status="compiled by nvcc", arch=arch, seconds=round(time.perf_counter() - start, 1))
