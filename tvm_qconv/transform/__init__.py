"""Relax passes of tvm_qconv, one per file (each IRModule -> IRModule)."""
from .lift_params import LiftConstantsToParams
from .quantize_int8 import QuantizeInt8
from .schedule_kernels import ScheduleInt8Kernels

__all__ = ["LiftConstantsToParams", "QuantizeInt8", "ScheduleInt8Kernels"]
