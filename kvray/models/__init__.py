"""Models that read and write their KV cache through kvray backings (the model-level proof)."""

from kvray.models.reference import (
    INDEXER_LAYER,
    MODEL_PRESETS,
    LayerKind,
    ModelConfig,
    ReferenceModel,
    decode_text,
    encode_text,
)

__all__ = [
    "INDEXER_LAYER",
    "MODEL_PRESETS",
    "LayerKind",
    "ModelConfig",
    "ReferenceModel",
    "decode_text",
    "encode_text",
]
