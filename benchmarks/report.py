"""Writes docs/benchmarks.md, and the results table in README.md, from the canonical results in benchmarks/results/.

    python -m benchmarks.report

Every figure in docs/benchmarks.md comes from a results JSON, with that file's provenance (commit, command, date,
machine). A file that is missing renders as "not measured yet" rather than failing. This module assembles the page
and the README's tables; each section's renderer lives with its kind (`report_fleet`, `report_multi_turn`,
`report_mechanisms`, `report_robustness`), on the helpers of `report_format`. To add a benchmark: write a function
that turns its JSON into markdown lines beside its kind and add a `Section` naming the file to SECTIONS.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO_ROOT, RESULTS_DIR
from benchmarks.report_fleet import (
    fleet_summary,
    render_fleet,
    render_fleet_pd,
    render_sensitivity,
    render_sim_fidelity,
)
from benchmarks.report_format import Results, generic, provenance_line
from benchmarks.report_mechanisms import (
    render_contention,
    render_cpu_dtype,
    render_crossover,
    render_directory,
    render_engine,
    render_engine_priority,
    render_frontend,
    render_lone,
    render_overhead,
    render_pd,
    render_progress_delay,
    render_scaling,
    render_two_cores,
    render_two_nodes,
)
from benchmarks.report_multi_turn import (
    MULTI_TURN,
    multi_turn_summary,
    multi_turn_summary_rows,
    render_aiperf,
    render_external,
    render_multi_turn,
)
from benchmarks.report_robustness import (
    render_fault_races,
    render_faults,
    render_fuzz,
    render_idle,
    render_log_budget,
    render_pull_verify,
    render_soak,
)

DOC = REPO_ROOT / "docs" / "benchmarks.md"
README = REPO_ROOT / "README.md"
COMMAND = "python -m benchmarks.report"


@dataclass(frozen=True)
class Section:
    """One part of docs/benchmarks.md: the results files it reads and how it renders those that exist."""

    title: str
    files: tuple[str, ...]
    about: str
    render: Callable[[Results], list[str]]


def load(results_dir: Path = RESULTS_DIR) -> Results:
    """Every results JSON in `results_dir` by file name; unreadable files are left out."""
    loaded: Results = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            loaded[path.name] = data
    return loaded


SECTIONS: list[Section] = [
    Section("Fleet simulation", ("fleet.json",),
            "Policies compared on a simulated fleet (`kvtransfer/sim`), per workload.", render_fleet),
    Section("Fleet simulation: P/D pull-back", ("fleet_pd_pr32553.json", "fleet_pd.json"),
            "Disaggregated prefill/decode on a simulated fleet: each turn's history pulled back from its decode "
            "replica (`kvrelay`) against recomputing it on the prefill side (`recompute`).", render_fleet_pd),
    Section("Fleet simulation: where pulling pays", ("fleet_sensitivity.json",),
            "The same comparison across link and compute speeds (`python -m benchmarks.fleet --sensitivity`).",
            render_sensitivity),
    Section("Simulator fidelity", ("sim_fidelity.json",),
            "How closely the fleet simulator reproduces measured runs: the same conversations on two modelled "
            "replicas of an engine profile measured on the same machine kind (`python -m benchmarks.sim_fidelity`).",
            render_sim_fidelity),
    Section("Control plane", ("control_plane.json",),
            "The directory's and the planner's own costs at fleet scale: the real ingress, directory and mirror over "
            "simulated replicas (`benchmarks.control_plane`).", generic("control_plane.json")),
    Section("An ingress replica's capacity", ("ingress_capacity.json",),
            "Streamed tokens per second through one and two ingress replicas over simulated H100 replicas at their "
            "modelled speed (`benchmarks.ingress_capacity`).", generic("ingress_capacity.json")),
    Section("Autoscaling on simulated replicas", ("sim_autoscaling.json",),
            "The engine pool from 2 replicas to 8 and back under a load ramp (`benchmarks.sim_autoscaling`).",
            generic("sim_autoscaling.json")),
    *[Section(f"Multi-turn routing: {label}", (name,),
              "kvrelay against the routers users would otherwise run, every policy on the same two engines "
              "(`benchmarks.multi_turn`).", render_multi_turn(name)) for name, label in MULTI_TURN.items()],
    Section("Multi-turn routing driven by aiperf", ("aiperf_multi_turn.json",),
            "The quick workload's conversations sent by NVIDIA's aiperf, which times the first token itself.",
            render_aiperf),
    Section("Multi-turn routing, external-style: a fresh app per policy", ("multi_turn_external.json",),
            "kvrelay against prefix affinity as an outside user measures them: aiperf's multi-turn mode against the "
            "app as `make serve` starts it, a fresh one per policy and run (`benchmarks.multi_turn_external`).",
            render_external("multi_turn_external.json")),
    Section("Multi-turn routing, external-style, at one offered load", ("multi_turn_external_open_loop.json",),
            "The same comparison with every policy sent the same turns a second "
            "(`benchmarks.multi_turn_external --request-rate`). Where one engine cannot serve that rate, prefix "
            "affinity, which keeps every conversation sharing a system prompt on the replica that cached it first, "
            "serves less than is sent (requests/s below the rate) and its queue grows for the whole run.",
            render_external("multi_turn_external_open_loop.json")),
    Section("A lone conversation", ("lone_conversation.json",),
            "One conversation on an idle fleet: whether it stays with its KV, and how close the estimates are.",
            render_lone),
    Section("Pull, recompute or stay: the planner's regret", ("crossover.json", "crossover_out_of_sample.json"),
            "Every option forced on the same turns, against the one the planner picks.", render_crossover),
    Section("Prefill/decode disaggregated: pulling the history back", ("pd_pullback.json",),
            "One prefill and one decode replica; each mode of getting a turn's history to the prefill replica.",
            render_pd),
    Section("Pulls across two Ray nodes", ("two_nodes.json",),
            "Two Ray nodes joined by a veth link (UCX over TCP) against two replicas on one node.", render_two_nodes),
    Section("A prefill beside a decoding engine", ("contention.json",),
            "TTFT of forced prefills while the other engine of the node decodes, over the same prefill alone.",
            render_contention),
    Section("What the ingress adds", ("overhead.json", "overhead_default_serve.json"),
            "The same request over HTTP through the ingress and straight to an engine replica's handle, paired.",
            render_overhead),
    Section("The OpenAI front end", ("frontend.json",),
            "vLLM's parse, render and derender as the ingress runs them, in one process.", render_frontend),
    Section("What a replica costs", ("scaling.json",),
            "One replica against two under the same load, and the cores an idle replica uses.", render_scaling),
    Section("Engines below the request path", ("engine_priority.json",),
            "The request path's latency beside two busy engines at its priority and at nice 19.",
            render_engine_priority),
    Section("NIXL's progress thread", ("progress_delay.json",),
            "An idle engine's CPU and pull TTFT with NIXL's progress poll timing out after 200 us and 10 ms.",
            render_progress_delay),
    Section("Do this machine's cores share work?", ("two_cores.json",),
            "Two processes pinned to two cores against one alone, on compute-, weight- and memory-bound kernels.",
            render_two_cores),
    Section("One engine", ("engine.json",),
            "Start-up, memory and token rates of one engine replica, and fast prefill on and off.", render_engine),
    Section("bf16 or fp32 on a CPU without native bf16", ("cpu_dtype.json",),
            "One engine at a time in each dtype: prefill and decode.", render_cpu_dtype),
    Section("The KV directory", ("directory.json",),
            "Lookups and records against a directory of 10,000 conversations.", render_directory),
    Section("Faults under load", ("faults.json",),
            "Scripted faults, each three times, under two background conversations; every turn checked token for "
            "token against a recompute.", render_faults),
    Section("Races around a pull's read", ("fault_races.json",),
            "Faults timed against a pull's read on an app with 10 s leases, every pull verified against its holder's "
            "digests and every answer checked token for token against a recompute (`benchmarks.faults --races`). A "
            "failed turn is one whose forced pull could not be planned (its error, recorded in the file: the hold was "
            "not offered), not one the app answered wrongly.", render_fault_races),
    Section("What pull verification costs", ("pull_verify.json",),
            "CRC32 of every held block at export and of every received block before use (`nixl.verify_pulls`), "
            "on two replicas of the default model (`benchmarks.pull_verify`).", render_pull_verify),
    Section("Log budget", ("log_budget.json",),
            "The app as `make serve` starts it, a multi-turn load, SIGTERM: every line its processes logged "
            "(`benchmarks.log_budget`).", render_log_budget),
    Section("An idle app", ("idle.json",),
            "Cores used by kvrelay's processes (engine replicas and their engines, ingress, directory) of the app "
            "as `make serve` starts it, in 10 s windows (`benchmarks.idle`).", render_idle),
    Section("Soak", ("soak.json",), "Steady load for half an hour: errors, memory and directory growth.",
            render_soak),
    Section("Fuzz", ("fuzz.json",), "Property-based requests of every shape against a live app.", render_fuzz),
]


def render_section(section: Section, results: Results) -> list[str]:
    lines = [f"## {section.title}", "", section.about, ""]
    present = [name for name in section.files if name in results]
    if not present:
        names = ", ".join(f"`benchmarks/results/{name}`" for name in section.files)
        return lines + [f"Not measured yet: no {names}.", ""]
    try:
        lines += section.render(results)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        lines += [f"_{', '.join(present)} does not have the fields this section reads ({error!r})._"]
    lines.append("")
    lines += [provenance_line(name, results[name]) + "\n" for name in present]
    return lines


def render_doc(results: Results) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by `{COMMAND}` from benchmarks/results/*.json; edit benchmarks/report.py, not this file. -->",
        "",
        "Every figure here is read from a results file in `benchmarks/results/`, named under its table with the "
        "commit, command, date and machine it came from. Figures compare only between runs on the same kind of "
        "machine: the same benchmark runs about 10x slower on an AVX2-only CPU than on one with AMX. A section "
        "whose file is missing says so. Regenerate with `" + COMMAND + "`.",
        "",
    ]
    lines += ["Contents: " + ", ".join(f"[{s.title}](#{anchor(s.title)})" for s in SECTIONS) + ".", ""]
    for section in SECTIONS:
        lines += render_section(section, results)
    return "\n".join(lines).rstrip() + "\n"


def anchor(title: str) -> str:
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


README_BEGIN = "<!-- BEGIN multi-turn results: generated by `python -m benchmarks.report` -->"
README_END = "<!-- END multi-turn results -->"


FLEET_BEGIN = "<!-- BEGIN fleet results: generated by `python -m benchmarks.report` -->"
FLEET_END = "<!-- END fleet results -->"


def readme_block(results: Results) -> str:
    rows = multi_turn_summary_rows(results)
    body = multi_turn_summary(results) if rows else ["No multi-turn results in benchmarks/results/ yet."]
    return "\n".join([README_BEGIN, *body, README_END])


def with_readme_block(readme: str, results: Results) -> str:
    """`readme` with its generated results tables replaced; unchanged where it has no markers."""
    for begin, end_marker, block in ((README_BEGIN, README_END, lambda: readme_block(results)),
                                     (FLEET_BEGIN, FLEET_END,
                                      lambda: "\n".join([FLEET_BEGIN, *fleet_summary(results), FLEET_END]))):
        start, end = readme.find(begin), readme.find(end_marker)
        if start >= 0 and end >= start:
            readme = readme[:start] + block() + readme[end + len(end_marker):]
    return readme


def main() -> None:
    results = load()
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render_doc(results))
    if README.exists():
        readme = README.read_text()
        updated = with_readme_block(readme, results)
        if updated != readme:
            README.write_text(updated)
    print(f"written {DOC.relative_to(REPO_ROOT)} from {len(results)} results files")


if __name__ == "__main__":
    main()
