"""Checkpoint loaders: read a model's expert weights from ``weight_path`` into a native MoELayer."""

from .hf import (
    CheckpointError,
    SafetensorsIndex,
    check_model_shape,
    find_config,
    load_bf16_layer,
    read_model_shape,
)

__all__ = [
    "CheckpointError",
    "SafetensorsIndex",
    "check_model_shape",
    "find_config",
    "load_bf16_layer",
    "read_model_shape",
]
