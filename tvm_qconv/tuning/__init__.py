"""MetaSchedule tuning of the int8 kernels, one module per role:

``tasks``     which kernels of a model are tuned, in the canonical form the database matches
``database``  MetaSchedule's JSON files: read, repair, pack, prune
``apply``     building with a database
``builder``   build workers that live for the whole run
``progress``  the per-round lines and the final table
``driver``    ``tune_model``: extract, seed with the default, search, resume
"""
from .apply import apply_tuning_database
from .database import load_database, prune_database
from .driver import default_work_dir, read_peaks, tune_model
from .progress import format_table
from .tasks import KernelTask, extract_tasks, task_func

__all__ = ["KernelTask", "apply_tuning_database", "default_work_dir", "extract_tasks", "format_table",
           "load_database", "prune_database", "read_peaks", "task_func", "tune_model"]
