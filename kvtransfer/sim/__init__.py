"""A modelled vLLM engine for fleet-scale studies: its prefix cache, scheduler and timing, no model and no GPU.

`profile` loads a hardware/model profile (every number with its source), `block_cache` keeps vLLM's block-level
prefix cache (vLLM's own block hashes, LRU eviction of unreferenced blocks, holds pinned until pulled), and
`engine` steps a continuous-batching scheduler in virtual time. The planner, cost model and directory that drive
it are kvrelay's real ones (`benchmarks/fleet_sim.py`). Never a stand-in for a real engine in a test of the engine
path: tokens, pulls, fast prefill and migration are tested on vLLM itself.
"""
