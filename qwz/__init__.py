"""qwz: ZeRO-1/2 with a bounded, group-wise int8 quantized weight all-gather."""

from qwz.checkpoint import CheckpointError
from qwz.config import DEFAULT_GROUP_SIZE, ConfigError, QwzConfig
from qwz.engine import Engine, initialize
from qwz.hashing import param_hash
from qwz.optimizer import NonFiniteError, ZeroOptimizer
from qwz.policies import GatherPolicy, OptimizerSpec, ReducePolicy
from qwz.quant import QuantizedTensor, dequantize, quantize

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "GatherPolicy",
    "NonFiniteError",
    "OptimizerSpec",
    "QuantizedTensor",
    "QwzConfig",
    "ReducePolicy",
    "ZeroOptimizer",
    "dequantize",
    "initialize",
    "param_hash",
    "quantize",
]
__version__ = "0.1.0"
