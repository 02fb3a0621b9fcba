"""The stem conv: a network's first conv (the image's 3-4 channels) on ``__dp4a``, from the
quantized input (NCHW4c) into the tensor-core families' NHWC32, so the layers after it start on
tensor cores with no layout conversion.  ``conv2d.py`` is the kernel, ``impls.py`` what the
registry sees.
"""
