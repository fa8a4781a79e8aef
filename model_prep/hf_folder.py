"""What every model preparation shares: progress lines, a quiet transformers, and the tokenizer and generation
config files of a Hugging Face folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Progress = Callable[[str], None]


def quiet_transformers() -> None:
    """Silence transformers' progress bars and load reports: they would drown our own progress lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def sync_generation_config(model: Any, tokenizer: Any) -> None:
    """Give the model a generation config with the tokenizer's special token ids."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tokenizer(tokenizer: Any, out: Path, max_len: int, extra: dict[str, Any] | None = None) -> None:
    """Save the tokenizer, then make sure tokenizer_config.json itself carries the chat template too.

    transformers 5 writes the template to chat_template.jinja only; older readers look in the JSON.
    """
    tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    cfg["model_max_length"] = max_len
    cfg.update(extra or {})
    # Drop fields that only describe where this process loaded from.
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
