"""The int8 kernels: TensorIR compute definitions, NumPy references, schedules and search spaces.

Installed as ``tvm_qconv.schedules``.  One folder per kernel family (``nchw4c/``: dp4a on CUDA and
the llvm schedule), ``training/`` for the training path's gradients, and the pieces every
family shares: ``kernel.py`` (the interface an implementation fills in), ``workload.py`` (what
each op's kernel computes), ``requantize.py`` (the fixed-point epilogue), ``quantize.py`` (float ->
int8 rounding), ``sched_utils.py`` (divisor tiles, loops under a compute_at), ``dense_int8.py``,
``layout_kernels.py`` (the memory-bound ops of every layout), ``conversion_kernels.py``
(quantize, dequantize, relayout and a linear layer's input rows, as implementations) and
``runtime_functions.py`` (the functions compiled kernels call at run time, which every process
that runs them registers).
``tvmscript_frames.py`` takes the ``inspect.stack()`` cost out of TVMScript's ``T.prim_func``.
"""
from . import tvmscript_frames

tvmscript_frames.install()
