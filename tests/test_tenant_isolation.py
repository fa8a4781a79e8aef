"""Tenants never share KV: another API key's turn, sent to the replica that holds the first key's KV with a prompt
that KV covers, computes its whole prompt.

Two layers keep tenants apart, and each is shown necessary here by a test double that removes it from an in-process
turn runner (the real engines, the real directory): the directory's scope, without which the turn is offered the
other tenant's hold and reads it, and vLLM's cache salt, without which the engine's prefix cache serves it the other
tenant's blocks. A hold is offered only to a prompt that extends what it holds, so the second tenant sends the prompt
the first tenant's next turn would send: its prompt, its reply and a new message.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

import httpx
import pytest

from tests.conftest import API_KEYS, ServedApp

MODEL = "tiny-llama"
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


class Served(NamedTuple):
    """How one turn was served: where, how many prompt tokens it did not compute (kvrelay's count and the engine's),
    and the tokens it generated."""

    replica: str
    reused_tokens: int
    cached_tokens: int
    output: list[int]


# (tenant, prompt token ids) -> how the turn was served; every turn of a scenario carries the same session id.
Send = Callable[[str, list[int]], Awaitable[Served]]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(40, 1000) for _ in range(n)]


async def second_tenant_sends_first_tenants_next_prompt(send: Send, tenants: tuple[str, str], seed: int
                                                        ) -> tuple[Served, Served, list[int]]:
    """Tenant A's first turn, then tenant B's turn with the prompt A's next turn would send (A's prompt, A's reply,
    a new message), both on one session, which pins B to the replica holding A's KV. Returns both and that prompt."""
    first_prompt = tokens(seed, 100)
    first = await send(tenants[0], first_prompt)
    next_prompt = first_prompt + first.output + tokens(seed + 1, 8)
    return first, await send(tenants[1], next_prompt), next_prompt


def assert_isolated(first: Served, second: Served) -> None:
    """The second tenant reused none of the first tenant's KV, on the replica where that KV is."""
    assert (second.reused_tokens, second.cached_tokens) == (0, 0), f"the second tenant reused the first's KV: {second}"
    assert second.replica == first.replica, f"not pinned to the first tenant's replica: {first} then {second}"


def test_another_api_key_sending_the_same_prompt_to_the_replica_holding_the_kv_reuses_none_of_it(tiny_app):
    session = f"tenants-{uuid.uuid4().hex[:8]}"

    async def send(api_key: str, prompt: list[int]) -> Served:
        body = {"model": MODEL, "prompt": prompt, "logprobs": 0, "return_tokens_as_token_ids": True, **GREEDY}
        # Session affinity runs every turn of the session on its replica: under kvrelay's policy the session only
        # breaks near-ties, and a replica still finishing the first tenant's turn can lose the second tenant's to
        # the idle one.
        headers = {"Authorization": f"Bearer {api_key}", "X-Session-Id": session, "x-kvrelay-policy": "session"}
        async with httpx.AsyncClient(timeout=120) as client:
            resp = await client.post(f"{tiny_app.base_url}/v1/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        result = resp.json()
        output = [int(t.removeprefix("token_id:")) for t in result["choices"][0]["logprobs"]["tokens"]]
        return Served(result["kvrelay"]["replica"], result["kvrelay"]["reused_tokens"],
                      result["usage"]["prompt_tokens_details"]["cached_tokens"], output)

    async def scenario() -> tuple[Served, Served, Served]:
        first, second, next_prompt = await second_tenant_sends_first_tenants_next_prompt(send, API_KEYS, seed=38)
        # The same prompt from the first key reuses its KV: what the second key got is isolation, not a miss.
        return first, second, await send(API_KEYS[0], next_prompt)

    first, second, own = asyncio.run(scenario())
    assert_isolated(first, second)
    assert own.reused_tokens > 0 and own.cached_tokens > 0, own


def drop_tenant_from_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory scope without its tenant: one scope per model, so turns find every tenant's holds."""
    from app import holds, turns
    from kvtransfer.prefix_key import Scope

    # Both places a turn's key is scoped: its lookup (the runner) and the hold it leaves (its record).
    for module in (turns, holds):
        monkeypatch.setattr(module, "Scope", lambda model, tenant: Scope(model, ""))


def send_no_cache_salt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine requests without vLLM's cache salt: one prefix cache for every tenant."""
    from app.turns import TurnRunner

    request = TurnRunner._request
    monkeypatch.setattr(TurnRunner, "_request",
                        lambda self, *args, **kwargs: request(self, *args, **kwargs).model_copy(
                            update={"cache_salt": None}))


async def in_process_runner_send(app: ServedApp, session: str) -> Send:
    """`Send` through a turn runner in this process, over the app's engines and KV directory, so a test double can
    replace a piece of it. Its first turn runs where the runner plans it, every later one on that replica (the
    runner's `_targets`, as a P/D decode stage limits where turns start), reusing there all the directory offers
    it. A session only breaks near-ties under kvrelay's policy, and the replica still finishing the first tenant's
    turn was not one."""
    from ray import serve

    from actors.replica_api import Sampling
    from app.directory_mirror import DirectoryMirror
    from app.turn_types import Turn
    from app.turns import TurnRunner
    from kvtransfer.cost_model import CostModel
    from kvtransfer.kv_shape import KVShape
    from kvtransfer.options import Mode
    from kvtransfer.planner import Plan
    from model_prep.store import model_path

    engines = serve.get_deployment_handle("engines", app_name=app.name)
    identity = await engines.identity.remote()
    mirror = DirectoryMirror(serve.get_deployment_handle("kv_directory", app_name=app.name), identity.block_size)
    mirror.start()
    deadline = time.monotonic() + 60
    while len(mirror.live()) < 2:
        assert time.monotonic() < deadline, "the mirror never saw both replicas"
        await asyncio.sleep(0.05)
    kv_bytes = KVShape.from_model_dir(model_path(MODEL), "float32", identity.block_size).kv_bytes
    class PinnedRunner(TurnRunner):
        home: str | None = None  # the replica its first turn ran on
        last: Turn | None = None  # the turn sent last

        def _targets(self) -> list[str] | None:
            return [self.home] if self.home else None

        def plan(self, turn: Turn, force: tuple[Mode, str] | None = None, targets: Sequence[str] | None = None
                 ) -> Plan:
            # A later turn reuses all its replica is offered (a hold it reads, its prefix cache) whatever that costs
            # against recomputing: on the tiny model the two are a near-tie, and a double that exposes another
            # tenant's hold must be caught whichever way the estimates fall.
            if self.home is not None and force is None:
                with contextlib.suppress(ValueError):  # nothing to reuse there: planned as usual
                    return super().plan(turn, (Mode.LOCAL, self.home), targets)
            return super().plan(turn, force, targets)

    runner = PinnedRunner(engines, mirror, CostModel(kv_bytes), MODEL, identity.block_size, hold_ttl_s=30.0)

    async def send(tenant: str, prompt: list[int]) -> Served:
        # A turn is planned once this ingress's mirror lists the previous turn's KV on its replica: the KV events and
        # the directory's change feed come after the answer.
        deadline = time.monotonic() + 30
        while runner.last is not None and runner.directory.lookup(runner.key(runner.last)).get(runner.home) is None:
            assert time.monotonic() < deadline, f"the mirror never listed {runner.last.tenant}'s KV on {runner.home}"
            await asyncio.sleep(0.05)
        turn = Turn(uuid.uuid4().hex, list(prompt), Sampling(**GREEDY).to_params(), tenant, session_id=session)
        deltas = [item async for item in runner.run(turn)]
        last, outcome = deltas[-1]
        public = outcome.public()
        # The second tenant's turn must be offered this hold for the directory-scope double to expose it.
        assert runner.home is not None or last.hold is not None, "the first turn left no hold"
        runner.home, runner.last = runner.home or public["replica"], turn
        return Served(public["replica"], public["reused_tokens"], last.num_cached_tokens,
                      [t for delta, _ in deltas for t in delta.token_ids])

    return send


def in_process_scenario(app: ServedApp, seed: int) -> tuple[Served, Served]:
    """The scenario above through a turn runner in this process (tenants named plainly: no API keys here): the first
    tenant's turn leaves a hold, which the second tenant's reads where the directory's scope is missing."""

    async def scenario() -> tuple[Served, Served, list[int]]:
        send = await in_process_runner_send(app, f"tenants-{uuid.uuid4().hex[:8]}")
        return await second_tenant_sends_first_tenants_next_prompt(send, ("tenant-a", "tenant-b"), seed)

    first, second, _ = asyncio.run(scenario())
    return first, second


def test_the_in_process_runner_the_doubles_modify_keeps_tenants_apart_unmodified(tiny_app):
    assert_isolated(*in_process_scenario(tiny_app, seed=380))


@pytest.mark.parametrize("remove_layer, seed", [pytest.param(drop_tenant_from_scope, 381, id="directory scope"),
                                                pytest.param(send_no_cache_salt, 382, id="cache salt")])
def test_without_either_isolation_layer_the_check_catches_the_reuse(tiny_app, monkeypatch, remove_layer, seed):
    """With the directory's scope or the engine's cache salt replaced by a double that drops the tenant, the second
    tenant reuses the first tenant's KV, and the check the API key test makes says so."""
    remove_layer(monkeypatch)
    first, second = in_process_scenario(tiny_app, seed)
    with pytest.raises(AssertionError, match="reused the first's KV"):
        assert_isolated(first, second)
