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

    def kvrelay_hold_digests(self, block_ids: list[list[int]]) -> list[list[list[int]]]:
        """CRC32 of each block of a hold this engine exported, per region (kvtransfer/kv_digest.py)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvtransfer.kv_digest import held_digests, pack

        return pack(held_digests(get_kv_transfer_group().connector_worker, block_ids))

    def kvrelay_read_verdict(self, hold_request_id: str) -> str | None:
        """kvrelay's connector's verdict on this engine's read of that hold, once (kvtransfer/throttled_nixl.py)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().read_verdict(hold_request_id)

    def kvrelay_lease_counts(self) -> dict[str, int]:
        """Reads and notices kvrelay's connector held back as a hold's lease was ending (kvtransfer/hold_lease.py)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().lease_counts()
