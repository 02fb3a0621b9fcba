"""The training path's gradient kernels (float32 sums over int8 operands), one per file."""
