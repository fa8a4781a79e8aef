"""Markdown building blocks for docs/benchmarks.md: number formatting, tables, a results file's provenance line,
and the fallback view of a results file no section renders by hand."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# Every loaded results JSON by file name (`benchmarks.report.load`).
Results = dict[str, dict[str, Any]]


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        # Small figures (cores, ratios, sub-millisecond times) keep three significant digits.
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def table(header: list[str], rows: list[list[Any]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def machine_text(machine: Any) -> str:
    if not isinstance(machine, dict):
        return str(machine) if machine else "not recorded"
    parts = [str(machine["cpu"])] if machine.get("cpu") else []
    if machine.get("cpus"):
        parts.append(f"{machine['cpus']} cores")
    if machine.get("simd_flags"):
        parts.append("/".join(f for f in machine["simd_flags"] if f.startswith(("avx512f", "avx2", "amx_tile"))
                              ) or ", ".join(machine["simd_flags"][:3]))
    return ", ".join(parts) or "not recorded"


def provenance_line(name: str, data: dict[str, Any]) -> str:
    prov = data.get("provenance") or {}
    commit = str(prov.get("commit", "unknown"))[:10]
    dirty = prov.get("dirty")
    state = " (uncommitted changes)" if dirty is True else "" if dirty is False else ""
    when = str(prov.get("date", "unknown"))[:10]
    rebuilt = " Provenance rebuilt from git history." if prov.get("reconstructed") else ""
    # A run saved under an earlier name is rerun with this file as its --out (the JSON keeps the command as run).
    command = re.sub(r"--out \S+", f"--out benchmarks/results/{name}", str(prov.get("command", "unknown")))
    return (f"Source: [`{name}`](../benchmarks/results/{name}) — commit `{commit}`{state}, {when}, "
            f"{machine_text(prov.get('machine'))}; command `{command}`.{rebuilt}")


def scalars(data: dict[str, Any], prefix: str = "") -> list[list[Any]]:
    """Every number, string or flag in `data` as (dotted key, value), provenance left out: the fallback view."""
    rows: list[list[Any]] = []
    for key, value in data.items():
        if key == "provenance":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += scalars(value, name + ".")
        elif not isinstance(value, list):
            rows.append([f"`{name}`", value])
    return rows


def generic(name: str) -> Callable[[Results], list[str]]:
    def render(results: Results) -> list[str]:
        return table(["figure", "value"], scalars(results[name])[:60])
    return render


def best_other(policies: dict[str, Any], key: str) -> tuple[str, float] | None:
    """The policy other than kvrelay with the lowest TTFT at percentile `key`, with that TTFT."""
    others = [(name, p["ttft_ms"][key]) for name, p in policies.items() if name != "kvrelay"]
    return min(others, key=lambda x: x[1]) if others else None
