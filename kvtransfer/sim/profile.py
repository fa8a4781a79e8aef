"""An engine profile: how long a modelled vLLM engine's steps and KV transfers take on one hardware/model pair.

Profiles are data (`configs/profiles/*.json`), each number with its source in the file's `sources`. A step of a
continuous-batching engine costs

    decode_ms = decode_ms_per_seq * decoding requests + decode_ms_per_kctx * their context / 1e3
    prefill_ms = prefill_ms_per_token * prefill tokens + prefill_ms_per_ktoken_ctx * sum k * (c + k/2) / 1e3
    step_ms = (base_ms + prefill_ms) * (1 + contention_per_busy_peer * other busy engines on the node)
              + decode_ms * (1 + decode_contention_per_busy_peer * other busy engines on the node)

for prefill chunks of k new tokens after c cached ones: a fixed part per step (weights read once, launch and
scheduling), a part per token (the matmuls), and attention over the context. Engines that share a node's cores and
memory slow each other's prefills and decodes by different amounts; a step without prefill takes its fixed part at
the decodes' rate (`decode_contention_per_busy_peer`, by default the same as `contention_per_busy_peer`). A pull costs
`fixed_ms + bytes / bandwidth` on its link (`same_node` or `other_node`), plus `handshake_ms` the first time two
engines meet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.engine import SIM_PROFILES_DIR


class Link(BaseModel):
    """One kind of path between two engines' KV caches."""

    model_config = ConfigDict(extra="forbid")
    fixed_ms: float = Field(ge=0)
    gb_s: float = Field(gt=0)

    def transfer_ms(self, nbytes: int) -> float:
        return self.fixed_ms + nbytes / (self.gb_s * 1e6)


class EngineProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    # Engine configuration (vLLM's own arguments where one exists).
    block_size: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)
    kv_cache_tokens: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    # Step time (module docstring).
    base_ms: float = Field(ge=0)
    decode_ms_per_seq: float = Field(ge=0)
    decode_ms_per_kctx: float = Field(ge=0)
    prefill_ms_per_token: float = Field(gt=0)
    prefill_ms_per_ktoken_ctx: float = Field(ge=0)
    contention_per_busy_peer: float = Field(default=0.0, ge=0)
    decode_contention_per_busy_peer: float | None = Field(default=None, ge=0)
    replicas_per_node: int = Field(default=1, ge=1)
    # KV transfer.
    same_node: Link
    other_node: Link
    handshake_ms: float = Field(default=0.0, ge=0)
    # What the ingress adds to a turn's first token outside the engine (routing, Serve's hops, streaming).
    request_overhead_ms: float = Field(default=0.0, ge=0)
    # How long a finished turn's KV stays held for a pull (kvrelay's `nixl.hold_ttl_s`).
    hold_ttl_s: float = Field(default=60.0, gt=0)
    # Where every number above comes from: field name -> source (a measurement with its command, or a citation).
    sources: dict[str, str]
    # A measured profile's raw samples and fit, and the commit, command and machine it was measured with.
    measurement: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _every_number_has_a_source(self) -> EngineProfile:
        numbers = [name for name in type(self).model_fields if getattr(self, name) is not None
                   and name not in ("name", "description", "sources", "measurement", "provenance")]
        missing = [n for n in numbers if n not in self.sources]
        if missing:
            raise ValueError(f"profile {self.name!r} gives no source for {missing}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        return self

    @property
    def decode_contention(self) -> float:
        """How much each busy peer slows a step's decodes: measured on its own, else the one contention factor."""
        if self.decode_contention_per_busy_peer is None:
            return self.contention_per_busy_peer
        return self.decode_contention_per_busy_peer

    @property
    def kv_cache_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def step_ms(
        self, decoding: int, decode_context: int, prefills: list[tuple[int, int]], busy_peers: int = 0
    ) -> float:
        """One engine step: `decoding` requests with `decode_context` tokens of context in all, and prefill chunks
        (new tokens, cached context) in the same batch, while `busy_peers` engines of the node work too."""
        decode = self.decode_ms_per_seq * decoding + self.decode_ms_per_kctx * decode_context / 1e3
        prefill = sum(self.prefill_ms_per_token * k + self.prefill_ms_per_ktoken_ctx * k * (c + k / 2) / 1e3
                      for k, c in prefills)
        if not busy_peers:
            return self.base_ms + decode + prefill
        slow_prefill = 1.0 + self.contention_per_busy_peer * busy_peers
        slow_decode = 1.0 + self.decode_contention * busy_peers
        if prefills:
            return (self.base_ms + prefill) * slow_prefill + decode * slow_decode
        return (self.base_ms + decode) * slow_decode

    def prefill_ms(self, new_tokens: int, context_tokens: int = 0) -> float:
        """A prefill alone on an idle engine, chunked by `max_num_batched_tokens`."""
        ms, done = 0.0, 0
        while done < new_tokens:
            k = min(self.max_num_batched_tokens, new_tokens - done)
            ms += self.step_ms(0, 0, [(k, context_tokens + done)])
            done += k
        return ms

    def pull_ms(self, num_tokens: int, same_node: bool, first_contact: bool = False) -> float:
        link = self.same_node if same_node else self.other_node
        return link.transfer_ms(num_tokens * self.kv_bytes_per_token) + (self.handshake_ms if first_contact else 0.0)


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """A profile by name (`configs/profiles/NAME.json`) or path."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = SIM_PROFILES_DIR / f"{name_or_path}.json"
    if not path.exists():
        known = sorted(p.stem for p in SIM_PROFILES_DIR.glob("*.json"))
        raise FileNotFoundError(f"no engine profile {name_or_path!r}; known: {known}")
    return EngineProfile.model_validate(json.loads(path.read_text()))
