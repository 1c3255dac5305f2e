"""The EXL2 on-disk format: tensors of a quantized linear, bit packing, option tables, config, reader/writer."""

from exl2_backend.format.build import build_qtensor
from exl2_backend.format.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS, QuantOption
from exl2_backend.format.packing import pack_columns, pack_scales, unpack_columns, unpack_scales
from exl2_backend.format.qtensor import BIT_WIDTHS, Group, QTensor, pad32, parse_groups, validate_qtensor
from exl2_backend.format.reader import (
    DenseLinear,
    LayerWeights,
    Linear,
    ModelWeights,
    iter_linear_keys,
    linear_shape,
    load_weights,
)
from exl2_backend.format.safetensors_io import ShardIndex, TensorInfo
from exl2_backend.format.writer import make_quantization_config, qtensor_tensors, write_model_dir

__all__ = [
    "ATTENTION_OPTIONS", "BIT_WIDTHS", "HEAD_OPTIONS", "MLP_OPTIONS", "SUPPORTED_ARCHITECTURES",
    "DenseLinear", "Group", "LayerWeights", "Linear", "ModelConfig", "ModelWeights", "QTensor", "QuantOption",
    "RopeScaling", "ShardIndex", "TensorInfo",
    "build_qtensor", "iter_linear_keys", "linear_shape", "load_weights", "make_quantization_config",
    "pack_columns", "pack_scales", "pad32", "parse_groups", "qtensor_tensors", "unpack_columns", "unpack_scales",
    "validate_qtensor", "write_model_dir",
]
