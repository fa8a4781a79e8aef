"""Random-weight models of a preset's shape (Llama, Gemma3n text), seeded, with the tiny tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from configs.models import ModelPreset
from model_prep.hf_folder import Progress, quiet_transformers, sync_generation_config
from model_prep.tiny_tokenizer import build_tokenizer

if TYPE_CHECKING:
    import torch


def build_random(preset: ModelPreset, out: Path, progress: Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    progress(f"[model_prep] training the tiny BPE tokenizer for {preset.name}")
    tokenizer = build_tokenizer(out, preset.max_model_len)
    vocab = len(tokenizer)
    config = _random_config(preset, tokenizer, vocab)
    progress(f"[model_prep] building random {preset.architecture} (vocab {vocab}, seed {preset.seed})")
    # from_config's own init draws from the global RNG; we overwrite every parameter from our generator.
    torch.manual_seed(preset.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, preset.seed)
    if preset.builder == "gemma3n_text":
        _zero_per_layer_embeddings(model)
    sync_generation_config(model, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    progress(f"[model_prep] writing {n_params / 1e6:.1f}M parameters (float32)")
    model.save_pretrained(out)


def _random_config(preset: ModelPreset, tokenizer: Any, vocab: int) -> Any:
    import torch

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    fields = dict(preset.hf_config)
    if preset.builder == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=vocab, **ids, **fields)
    elif preset.builder == "gemma3n_text":
        from transformers import Gemma3nTextConfig

        # Per-layer embeddings cover the whole vocab: vLLM and HF disagree on out-of-range ids otherwise.
        config = Gemma3nTextConfig(vocab_size=vocab, vocab_size_per_layer_input=vocab, **ids, **fields)
    else:
        raise ValueError(f"unknown builder {preset.builder!r}")
    config.architectures = [preset.architecture]
    config.dtype = torch.float32
    return config


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in name order.

    Fan-in scaled normals keep activations O(1), so logits are far from ties and fp32 engines agree on
    greedy tokens. Norm gains get 1 +/- noise and other vectors (e.g. AltUp output scales) small noise
    rather than the HF init of exact ones/zeros, so every branch of the model really contributes.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.ndim >= 2:
                std = param.shape[-1] ** -0.5
                values = torch.randn(param.shape, generator=gen) * std
            elif "norm" in name:
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            else:
                values = 0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(values.to(param.dtype))


def _zero_per_layer_embeddings(model: torch.nn.Module) -> None:
    """Zero Gemma3n's per-layer token embeddings so vLLM's text-only model computes what HF computes.

    vLLM 0.32's `Gemma3nForCausalLM` never looks these embeddings up (only the multimodal wrapper does) and
    also skips the 1/sqrt(2) mixing scale. With the table at zero, HF's per-layer input is the projection
    branch times a constant, and the RMSNorm after the per-layer gate removes that constant.
    """
    import torch

    with torch.no_grad():
        model.model.embed_tokens_per_layer.weight.zero_()
