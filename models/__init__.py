"""Model definitions of tvm_qconv (torchvision models come from torchvision itself)."""
from .vgg import SmallVGG

__all__ = ["SmallVGG"]
