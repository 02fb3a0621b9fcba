"""The Relax rewrites of a build: before the analysis, channels-last regions as NCHW ops
(``channels_first``); after lowering, weights lifted to parameters and kernels scheduled."""
from .lift_params import LiftConstantsToParams
from .schedule_kernels import ScheduleInt8Kernels

__all__ = ["LiftConstantsToParams", "ScheduleInt8Kernels"]
