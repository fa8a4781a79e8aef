"""Pull verification (opt-in, `NixlSettings.verify_pulls`): a pulled KV is used only if its bytes are the holder's.

At export the holder's worker takes a CRC32 of every held block, region by region (`held_digests`), and the digests
travel with the hold. When a read has finished, before any step can use the blocks, the reader's worker takes the
CRC32 of each block it received and compares it with the holder's for the block it was read from
(`ReadVerifier.check`); a mismatch fails the read as a failed pull does, so the turn is computed instead. Blocks
are paired as vLLM's NIXL worker pairs a pull (`paired_blocks`). The connector keeps each read's verdict for the
reader's replica to collect: /kvrelay/stats and /metrics count pulls verified and refused.

CRC32 catches any accidental difference (another conversation's KV in reused blocks, a torn read) but is no
defence against forgery, which the hold's seal (kvtransfer/types.py) is for. The blocks are read in host memory:
verification needs a KV cache there (the CPU platform, or `kv_buffer_device: cpu`).
"""

from __future__ import annotations

import ctypes
import zlib
from typing import Any

# In an exported hold's kv_transfer_params: per tensor-parallel rank, per region, the CRC32 of each held block.
DIGESTS_KEY = "kvrelay_block_digests"
# kv_connector_extra_config: whether readers verify what they pulled.
VERIFY_KEY = "kvrelay_verify_pulls"
# Attribute of the scheduler's connector metadata: {request id: the digests its hold carries} for this step's reads.
METADATA_ATTR = "kvrelay_expected_digests"



def paired_blocks(worker: Any, held: Any, local: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(held, local) physical block ids per registered region, paired as vLLM's NIXL worker pairs a pull: `local`
    (vLLM's logical ids per KV cache group: the blocks a request does not have cached) matched to the tail of
    `held`."""
    ratio = worker._physical_blocks_per_logical_kv_block
    dst, src = worker._apply_prefix_caching(worker._logical_to_kernel_block_ids(local, ratio),
                                            worker._logical_to_kernel_block_ids(held, ratio), ratio, ratio)
    return (worker._block_ids_by_region(src, worker.region_group_ids),
            worker._block_ids_by_region(dst, worker.region_group_ids))


def _regions(worker: Any) -> list[tuple[int, int, int]]:
    """(base address, block stride, block length) of each region this worker registered with NIXL."""
    bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    return [(base, worker.block_stride_per_layer[r], worker.block_len_per_layer[r]) for r, base in enumerate(bases)]


def _crc(base: int, stride: int, length: int, block: int) -> int:
    return zlib.crc32((ctypes.c_char * length).from_address(base + block * stride))


def held_digests(worker: Any, held: Any) -> list[dict[int, int]]:
    """Per region, {physical block id: CRC32} of every block of a hold (vLLM's logical ids per KV cache group)."""
    if worker.device_type != "cpu":
        raise RuntimeError("pull verification reads KV blocks in host memory; this engine keeps them on "
                           f"{worker.device_type} (turn nixl.verify_pulls off)")
    ratio = worker._physical_blocks_per_logical_kv_block
    by_region = worker._block_ids_by_region(worker._logical_to_kernel_block_ids(held, ratio), worker.region_group_ids)
    return [{b: _crc(base, stride, length, b) for b in blocks if b}
            for (base, stride, length), blocks in zip(_regions(worker), by_region, strict=True)]


def expected_digests(pending_recv: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """The holder's digests carried by this step's reads (vLLM's `_reqs_need_recv`, scheduler side)."""
    return {req_id: entry[0].kv_transfer_params[DIGESTS_KEY] for req_id, entry in pending_recv.items()
            if (entry[0].kv_transfer_params or {}).get(DIGESTS_KEY) is not None}


class ReadVerifier:
    """The reader's side, on vLLM's NIXL worker: the holder's digests of each read in flight, checked when it ends."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._expected: dict[str, tuple[Any, list[dict[int, int]]]] = {}  # request id -> (its ReqMeta, digests)

    def admit(self, metadata: Any) -> None:
        """Remember the holder's digests of each read this step starts (by this worker's tensor-parallel rank)."""
        digests: dict[str, Any] = getattr(metadata, METADATA_ATTR, None) or {}
        for req_id, meta in metadata.reqs_to_recv.items():
            if meta.awaiting_kvs and req_id in digests:
                per_rank = digests[req_id][self.worker.tp_rank]
                self._expected[req_id] = (meta, [{int(b): c for b, c in region} for region in per_rank])

    def check(self, finished: set[str], failed: set[str]) -> tuple[set[str], set[str]]:
        """Compare each read finished this step with its holder's digests: (verified, refused)."""
        verified, refused = set(), set()
        done = finished & self._expected.keys()
        regions = _regions(self.worker) if done else []
        for req_id in done:
            meta, expected = self._expected.pop(req_id)
            if req_id in failed:
                continue
            src, dst = paired_blocks(self.worker, meta.remote.block_ids, meta.local_block_ids)
            ok = all(_crc(*regions[r], d) == expected[r].get(s)
                     for r in range(len(regions)) for s, d in zip(src[r], dst[r], strict=False) if s and d)
            (verified if ok else refused).add(req_id)
        return verified, refused


def pack(digests: list[dict[int, int]]) -> list[list[list[int]]]:
    """`held_digests` as kv_transfer_params carry them (JSON: no integer keys)."""
    return [sorted(region.items()) for region in digests]
