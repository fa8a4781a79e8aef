"""`python -m model_prep NAME [NAME...]`: prepare model presets ahead of time (`--list` shows which are ready)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from configs.models import DEFAULT_MODEL, MODEL_PRESETS
from model_prep.gguf import ModelUnavailableError
from model_prep.store import DATA_DIR_ENV, ensure_model, is_ready


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_prep", description="Prepare kvrelay model presets as HF folders."
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
