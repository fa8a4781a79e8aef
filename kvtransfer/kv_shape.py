"""How many bytes of KV a conversation of n tokens occupies, computed from a model's HF config.

A pull moves exactly these bytes, so the cost model's per-byte term is only as good as this count:
KV-sharing layers (Gemma3n) store nothing of their own, and sliding-window layers keep at most a window
(plus one partly filled block) of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class KVShape:
    """Per-layer KV geometry of the layers that own a KV cache."""

    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of KV that `num_tokens` tokens of context occupy (what a pull of them transfers)."""
        full = self.full_layers * num_tokens
        sliding = 0
        if self.sliding_layers:
            window = self.sliding_window or num_tokens
            # vLLM keeps whole blocks: the window plus the block it starts in.
            sliding = self.sliding_layers * min(num_tokens, window + self.block_size)
        return (full + sliding) * self.bytes_per_token_per_layer

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], dtype: str, block_size: int) -> KVShape:
        hf = hf.get("text_config", hf)
        num_layers = hf["num_hidden_layers"]
        shared = hf.get("num_kv_shared_layers", 0) or 0
        owning = range(num_layers - shared)
        layer_types = hf.get("layer_types")
        window = hf.get("sliding_window")
        if layer_types and window:
            sliding = sum(1 for i in owning if layer_types[i] == "sliding_attention")
        elif window and hf.get("use_sliding_window", False):
            sliding = len(owning)
        else:
            sliding = 0
        heads = hf["num_attention_heads"]
        return cls(
            full_layers=len(owning) - sliding,
            sliding_layers=sliding,
            sliding_window=window if sliding else None,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            dtype_bytes=DTYPE_BYTES[dtype],
            block_size=block_size,
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path, dtype: str, block_size: int) -> KVShape:
        import json

        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()), dtype, block_size)
