"""Which dtype an engine runs when its config names none: the model's recommended one, unless that is bf16 and the
CPU has no native bf16 (pure functions: the hardware cases are given as /proc/cpuinfo texts)."""

from __future__ import annotations

from actors.vllm_engine import cpu_has_native_bf16
from configs.engine import EngineConfig

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS) and cpu_has_native_bf16(GRAVITON3)
    assert not cpu_has_native_bf16(EPYC_AVX2) and not cpu_has_native_bf16(GRAVITON2)
    assert cpu_has_native_bf16("")  # nothing to read: the recommended dtype stays


def test_a_recommended_bf16_runs_as_fp32_only_where_the_cpu_has_no_native_bf16():
    real = EngineConfig(model="smollm2-135m-instruct")  # recommends bf16
    assert real.dtype is None
    assert real.engine_dtype(native_bf16=True) == "bfloat16"
    assert real.engine_dtype(native_bf16=False) == "float32"
    # A dtype the user names is what runs, whatever the CPU.
    assert EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16").engine_dtype(native_bf16=False) == "bfloat16"
    assert EngineConfig(model="smollm2-135m-instruct", dtype="float32").engine_dtype(native_bf16=True) == "float32"
    # A model recommending fp32 keeps it.
    assert EngineConfig(model="tiny-llama").engine_dtype(native_bf16=True) == "float32"
