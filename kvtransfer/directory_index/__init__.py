"""The KV directory: an exact, bounded, fast record of which engine replica holds which prefix's KV.

`index.KVDirectory` is the synchronous core (pure Python, single-threaded, injectable clock), built in layers:
`chains` (the prefix chains and who holds each block), `holds` (exported holds), `resident` (each replica's
prefix cache), with `records` for the internal records and what they cost in memory, and `changes`, the feed of
its updates. `actors.kv_directory.KVDirectoryActor` is the Ray actor that owns one (`app/builder.py` deploys it)
and feeds every ingress's mirror of it (`app/directory_mirror.py`). `results` has what its methods return; what a
lookup returns lives in `kvtransfer.types`.

The directory is a hint that is safe to lose: a missing entry costs speed, never a wrong answer. Matched
counts are exact for what it was told (full blocks by 120-bit chained hash, a hold's partial last block
by its stored tokens), and an expired or consumed hold is never offered.
"""
