"""The NCHW4c kernel family (seed 001): int8 activations ``[n, c/4, h, w, 4]``, weights OIHW4o4i.

Read in this order: ``layout.py`` (the layout and its float boundary kernels), ``conv2d.py``
(the fused conv's compute definition and NumPy reference), ``dp4a.py`` (its CUDA schedule on
``__dp4a``), ``dp4a_space.py`` (MetaSchedule spaces), ``cpu.py`` (its llvm schedule),
``depthwise.py`` (depthwise conv), ``impls.py`` (what the registry sees).  The pools, adds,
concats and stand-alone batch norms of every layout are one file each in ``schedules/``
(``layout_kernels.py`` instantiates them per layout).
"""
