"""The fleet simulator's fidelity check (`benchmarks/sim_fidelity.py`): it serves the real run's own conversations
on a profile of the engine the real run ran."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.sim_fidelity import compare, profile_dtype, served_profile, simulate
from kvtransfer.sim.profile import load_profile

# Two conversations of a real run's records as `benchmarks.multi_turn` writes them (fields the check reads).
TURNS = {"conv-0": [(830, 16), (1011, 20), (1150, 18)], "conv-1": [(900, 24), (1060, 16)]}


def real_run(dtype: str) -> dict[str, Any]:
    requests = [{"policy": policy, "round": 0, "conv_id": conv, "turn": turn, "ok": True, "ttft_ms": 500.0,
                 "tpot_ms": 40.0, "prompt_tokens": prompt, "completion_tokens": reply,
                 "reused_tokens": 192 if turn == 0 else prompt - 120}
                for policy in ("kvrelay", "round_robin") for conv, turns in TURNS.items()
                for turn, (prompt, reply) in enumerate(turns)]
    engine = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024**2, "dtype": dtype}
    return {"config": {"conversations": 2, "concurrency": 2, "policies": ["kvrelay", "round_robin"], "rounds": 1,
                       "model": "smollm2-135m-instruct", "engine": engine},
            "policies": {p: {"ttft_ms": {"p50": 500.0, "p90": 600.0}} for p in ("kvrelay", "round_robin")},
            "requests": requests, "provenance": {"machine": {"native_bf16": True}}}


def test_the_simulation_serves_every_real_turn_with_its_prompt_length():
    profile = load_profile("cpu-smollm2")
    real = real_run(profile_dtype(profile))
    sim = simulate(served_profile(profile, real), real, seed=0)
    for policy in ("kvrelay", "round_robin"):
        assert {k: v["prompt_tokens"] for k, v in sim[policy].items()} == {
            (0, conv, turn): prompt for conv, turns in TURNS.items() for turn, (prompt, _) in enumerate(turns)}
    split = compare(real, sim)["policies"]["kvrelay"]["by_turn_kind"]
    assert split["first_turns"]["turns"] == 2 and split["later_turns"]["turns"] == 3
    assert split["later_turns"]["new_tokens_p50"]["sim"] < split["first_turns"]["new_tokens_p50"]["sim"]


def test_a_profile_of_an_engine_in_another_dtype_is_refused():
    profile = load_profile("cpu-smollm2")
    other = "float32" if profile_dtype(profile) == "bfloat16" else "bfloat16"
    with pytest.raises(SystemExit, match=f"sim_profile --dtype {other}"):
        served_profile(profile, real_run(other))


def test_a_profile_measured_on_another_kind_of_cpu_is_refused():
    profile = load_profile("cpu-smollm2")
    real = real_run(profile_dtype(profile))
    real["provenance"]["machine"]["cpu"] = "another CPU"
    with pytest.raises(SystemExit, match="measure both on one kind of machine"):
        served_profile(profile, real)
    del real["provenance"]["machine"]["cpu"]  # a real run that does not record its CPU is compared as before
    served_profile(profile, real)
