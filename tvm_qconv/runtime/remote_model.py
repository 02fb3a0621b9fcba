"""A built library run on a remote device through TVM RPC (``deploy.py rpc``).

    with RemoteModel("build/vgg16.so", Remote.parse(tracker="127.0.0.1:9190", key="h100")) as model:
        logits = model(x)                  x: float32 NCHW, the library's input shape
        model.latency(x, repeat=100)       {"median_ms", "p90_ms", "p99_ms", ...}

The three files are checked here first (:func:`artifact.check_whole`: one build), then the
``.so`` is uploaded into the server's temporary folder under a name carrying its build id and
loaded from there, and the params are copied into the remote device's memory: nothing is loaded
remotely that the client did not upload in this session.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import tvm
from tvm import relax

from .artifact import artifact_paths, open_library
from ..errors import InputError
from .remote import Remote, remote_gpu
from .compiled_model import check_arch, flatten
from ..schedules import runtime_functions


class RemoteModel:
    """A built int8 library loaded on the remote device of ``remote``.

    Attributes:
        meta: the library's ``.json`` record.
        device_name: the remote device's name (e.g. ``NVIDIA H100 80GB HBM3``, or ``cpu``).
    """

    def __init__(self, lib_path: str, remote: Remote):
        self.meta = open_library(lib_path)
        params_path, _ = artifact_paths(lib_path)
        self.remote = remote
        self.session = remote.connect(session_timeout=0)  # a long benchmark must not be cut
        try:
            self._load(lib_path, params_path, remote)
        except BaseException:
            self.close()  # a server of its own would wait for this session to end
            raise

    def _load(self, lib_path: str, params_path: str, remote: Remote) -> None:
        if self.meta["target"] == "cuda":
            self.dev, arch, self.device_name = remote_gpu(self.session)
            check_arch(lib_path, self.meta.get("arch"), arch)
            kernels = {layer.get("kernel", "") for layer in self.meta.get("report", {}).get("layers", [])}
            for f in runtime_functions.called_by(kernels):
                if not _has_function(self.session, f.name):
                    raise InputError(f"{lib_path} has {f.family} kernels, which call {f.name}, and the server at "
                                     f"{remote.describe()} lacks it: start the server with `python -m "
                                     f"tvm_qconv.cli.rpc_server` (not tvm.exec.rpc_server), or rebuild with --family "
                                     f"{f.instead}")
        else:
            self.dev, self.device_name = self.session.cpu(0), "cpu"
        remote_name = f"tvm_qconv_{self.meta.get('build_id', 'lib')}_{os.path.basename(lib_path)}"
        try:
            self.session.upload(lib_path, remote_name)
            module = self.session.load_module(remote_name)
        except Exception as err:  # the server's loader: another CPU arch or OS, a missing runtime
            raise InputError(f"the server at {remote.describe()} could not load {lib_path} "
                             f"({str(err).strip().splitlines()[-1][:200]}): build the library for that machine "
                             f"(--target/--arch), with the TVM version its server runs") from None
        self.vm = relax.VirtualMachine(module, self.dev)
        with np.load(params_path) as npz:
            self.params = [tvm.runtime.tensor(npz[n], self.dev) for n in self.meta["param_names"]]
        self.input_shape = tuple(self.meta["input_shape"])

    def close(self) -> None:
        """End the session (a server of its own serves one session at a time): drop every remote
        handle (module, tensors, device), which closes the connection."""
        self.vm = self.params = self.dev = self.session = None
        gc.collect()  # remote handles in reference cycles would keep the connection open

    def __enter__(self) -> "RemoteModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The logits (first output) for the batch ``x``, fetched back from the remote device."""
        self._set_input(x)
        self.vm.invoke_stateful("main")
        return flatten(self.vm.get_outputs("main"))[0]

    def _set_input(self, x: np.ndarray) -> None:
        if x.ndim != 4 or tuple(x.shape) != self.input_shape:
            raise InputError(f"input has shape {tuple(x.shape)}, this library was built for {self.input_shape}: "
                             f"give {self.input_shape[0]} image(s), or rebuild with --batch/--image-size")
        xt = tvm.runtime.tensor(np.ascontiguousarray(x, dtype=np.float32), self.dev)
        self.vm.set_input("main", xt, *self.params)

    def latency(self, x: np.ndarray, repeat: int = 100, warmup: int = 10) -> dict:
        """Latency of one call on the remote device, measured there (``time_evaluator``: device
        synchronized, each of ``repeat`` runs timed alone after ``warmup`` untimed ones).

        Returns:
            median_ms, p90_ms, p99_ms, min_ms, runs.
        """
        self._set_input(x)
        for _ in range(warmup):
            self.vm.invoke_stateful("main")
        timer = self.vm.time_evaluator("invoke_stateful", self.dev, number=1, repeat=repeat)
        ms = np.array(timer("main").results) * 1e3
        return {"median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
                "p99_ms": float(np.percentile(ms, 99)), "min_ms": float(ms.min()), "runs": int(ms.size)}


def _has_function(session, name: str) -> bool:
    try:
        session.get_function(name)
        return True
    except Exception:  # noqa: BLE001 (TVM raises AttributeError or its own error for a missing name)
        return False
