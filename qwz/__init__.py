"""qwz: ZeRO-1/2 with a bounded, group-wise int8 quantized weight all-gather."""

from qwz.config import DEFAULT_GROUP_SIZE, ConfigError, QwzConfig
from qwz.quant import QuantizedTensor, dequantize, quantize

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "ConfigError",
    "QuantizedTensor",
    "QwzConfig",
    "dequantize",
    "quantize",
]
__version__ = "0.1.0"
