"""Model definitions of tvm_qconv (torchvision models come from torchvision itself)."""
from .quantized_resnet import quantized_resnet50, swap_layers
from .quantized_vgg import QuantizedVGG16, SmallQuantizedVGG
from .vgg import SmallVGG

__all__ = ["SmallVGG", "QuantizedVGG16", "SmallQuantizedVGG", "quantized_resnet50", "swap_layers"]
