"""Methods mixed into vLLM's worker (via `worker_extension_cls`) so a replica can inspect the live model runner."""

from __future__ import annotations

from typing import Any


class KVRelayWorkerExtension:
    """Called through `AsyncLLM.collective_rpc(name)`; runs inside each vLLM worker process."""

    def kvrelay_attention_groups(self) -> list[dict[str, Any]]:
        """Each attention group's backend class and layers, per KV cache group."""
        runner = self.model_runner  # type: ignore[attr-defined]
        groups = []
        for kv_group_id, attn_groups in enumerate(runner.attn_groups):
            for group in attn_groups:
                groups.append(
                    {
                        "kv_cache_group": kv_group_id,
                        "backend": group.backend.__name__,
                        "layer_names": list(group.layer_names),
                    }
                )
        return groups
