"""MetaSchedule's LocalBuilder with build workers that live for the whole tuning run."""
from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder.local_builder import _worker_func
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

# Per candidate, worker start included.  Workers here do not import tvm.s_tir.tensor_intrin
# (_build_function), so start-up is a plain `import tvm` (~5 s); NVRTC/nvcc of one kernel takes
# seconds.  A candidate still compiling after this is pathological (huge explicit unroll).
BUILD_TIMEOUT_S = 120.0


def _build_function():
    """MetaSchedule's LocalBuilder build function, without its ``import tvm.s_tir.tensor_intrin``.

    The stock ``default_build`` imports every tensor intrinsic in each popen worker (~20 s on a
    16-core GPU host, over a minute on a small box), once per worker.  A candidate reaches the
    builder already tensorized, so the worker needs no intrinsic registry.  Defined in a closure
    so cloudpickle ships it by value.
    ``with target`` gives nvcc/NVRTC the arch where no GPU can be queried.  Candidates compile
    with the pipeline and options every CUDA kernel of the project compiles with
    (``registry.compile_options``: the tensor-core family's passes, which leave other kernels
    alone), so the worker imports ``tvm_qconv`` (the repository is on its path, or installed).
    A candidate whose trace only records a decision (the wgmma family's config) is replaced by
    the kernel it stands for first (``registry.realize``).
    """
    def build(mod, target, _params):
        # run in the worker, which gets this closure by value and none of this module's imports
        import tvm

        from tvm_qconv import registry  # in the worker: registers the kernels' TIR pipeline

        options = registry.compile_options()
        mod = registry.realize(mod, target)  # a wgmma candidate's trace -> its kernel
        with target, tvm.transform.PassContext(opt_level=3, config=options["config"]):
            # a runtime.Module, as the exporter expects
            return tvm.tirx.build(mod, target=target, pipeline=options["tir_pipeline"])
    return build


@derived_object
class PersistentLocalBuilder(ms.builder.PyBuilder):
    """MetaSchedule's LocalBuilder, with one pool of build workers kept for the whole run.

    The stock LocalBuilder starts a fresh PopenPoolExecutor for every batch (against a memory
    leak of long-lived workers), so each round pays the workers' ``import tvm`` again: ~25 s
    per round on the H200 host with 16 workers, as much as the builds themselves.  Here workers
    live across rounds and are recycled after ``max_uses`` builds each, which bounds the leak.
    Builds run ``_build_function`` and export exactly as LocalBuilder's workers do.
    """

    def __init__(self, max_workers: int, timeout_sec: float = BUILD_TIMEOUT_S, max_uses: int = 64):
        self.timeout_sec = timeout_sec
        self.f_build = _build_function()
        self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec, maximum_process_uses=max_uses)

    def build(self, build_inputs: list) -> list:
        results = []
        for res in self.pool.map_with_error_catching(
                lambda x: _worker_func(*x), [(self.f_build, None, b.mod, b.target, None) for b in build_inputs]):
            if res.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(res.value, None))
            elif res.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(None, f"build timed out after {self.timeout_sec} s"))
            else:
                results.append(ms.builder.BuilderResult(None, f"build failed:\n{res.value}"))
        return results

    def shutdown(self) -> None:
        self.pool.shutdown()
