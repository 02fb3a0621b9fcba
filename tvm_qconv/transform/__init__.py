"""The Relax module passes of a build after lowering: weights lifted to parameters, kernels scheduled."""
from .lift_params import LiftConstantsToParams
from .schedule_kernels import ScheduleInt8Kernels

__all__ = ["LiftConstantsToParams", "ScheduleInt8Kernels"]
