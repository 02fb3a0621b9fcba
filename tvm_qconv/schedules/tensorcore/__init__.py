"""The int8 tensor-core kernel family: the fused conv as an implicit GEMM on ``mma.sync.m16n8k32``
in the NHWC32 layout.

Read in this order: ``layout.py`` (NHWC32: why NHWC, why 32), ``conv2d.py`` (compute definition
and NumPy reference), ``mma.py`` (the schedule template and its default), ``space.py``
(MetaSchedule space), ``pipeline.py`` (TVM pipeline workarounds), ``impls.py`` (what the
registry sees).  ``docs/tensorcore.md`` explains the kernel.
"""
