"""The Hopper kernel family: the fused int8 conv on ``wgmma.mma_async`` (sm_90a), fed by TMA.

Read in this order: ``conv2d.py`` (the kernel and its decisions), ``tensormap.py`` (the host's
TMA im2col descriptor), ``space.py`` (the decisions as tuning records), ``impls.py`` (what the
registry sees).  It reuses the mma.sync family's
NHWC32 layout, compute definition and packed weights (``schedules/tensorcore``), and its
pipeline, which lowers hand-written TIRx kernels first.  ``docs/wgmma.md`` explains the design.
"""
