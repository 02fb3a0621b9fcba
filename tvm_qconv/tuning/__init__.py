"""MetaSchedule tuning of the int8 kernels, one module per role:

``tasks``     which kernels of a model are tuned, in the canonical form the database matches
``database``  MetaSchedule's JSON files: read, repair, pack, prune
``apply``     building with a database
``builder``   build workers that live for the whole run
``progress``  the per-round lines and the final table
``job``       ``TuneJob``: what to tune, how long, where it is measured, where results go
``driver``    ``tune(job)``: extract, seed with the default, search, resume
"""
from .apply import apply_tuning_database
from .database import load_database, prune_database
from .job import TuneJob, default_work_dir
from .progress import format_table
from .tasks import KernelTask, extract_tasks, task_func

__all__ = ["KernelTask", "TuneJob", "apply_tuning_database", "default_work_dir", "extract_tasks", "format_table",
           "load_database", "prune_database", "read_peaks", "task_func", "tune", "tune_model"]

_DRIVER = ("read_peaks", "tune", "tune_model")


def __getattr__(name):
    if name in _DRIVER:
        # the driver runs the build pipeline, which applies databases through this package's `apply`:
        from . import driver  # here, not at the top: there the package and the pipeline would import each other
        return getattr(driver, name)
    raise AttributeError(f"module 'tvm_qconv.tuning' has no attribute {name!r}")
