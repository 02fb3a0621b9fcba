"""The training path's kernels, one per file: the gradients (float32 sums over int8 operands), the
one-pass elementwise kernels around the int8 convs (``elementwise.py``), and the kernels an int8
conv may be measured and built with (``conv_choices.py``)."""
