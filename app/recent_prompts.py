"""Where the prompts of an ingress's recent turns ended: whether a new turn continues a conversation after its
hold has expired.

The planner prices a placement for the later turns its conversation will bring, from the share of turns that
continue one (`WorkloadForecast.expected_future_turns`). The KV directory answers "continues" from pending
holds (`KVDirectory.continues`), and a hold lasts its lease (10 s by default). Users who think longer than that between
turns left no hold, so every later turn counted as a new conversation: the think-time workload (12 s between turns)
ended with 0.0 later turns expected (a think-time run committed in 131fbb1). This keeps, per turn,
where its prompt ends as the next turn will see it (`PrefixKey.prompt_end`, as the directory records per hold) for
`ttl_s`, bounded in count; a later prompt that contains it as one of its blocks starts with that whole prompt.
Block hashes are chained and scoped to the tenant, so a new conversation sharing only a system prompt, or another
tenant's, never matches. It also keeps each turn's place in its conversation (0 for a first turn), so a turn knows
how many came before it: how many more to expect depends on that (`WorkloadForecast.expected_future_turns`). Not
thread-safe; the ingress's event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from kvtransfer.prefix_key import BlockHash, PrefixKey

# Long enough for a person to read a reply and write the next message; conversations idle for longer count as new.
RECENT_PROMPT_TTL_S = 600.0
# At most this many prompt ends are kept (about 130 bytes each), the oldest dropped first.
MAX_RECENT_PROMPTS = 50_000


class RecentPrompts:
    def __init__(self, ttl_s: float = RECENT_PROMPT_TTL_S, max_entries: int = MAX_RECENT_PROMPTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        # prompt end -> (when it expires, the turn's index in its conversation or None), oldest first
        self._ends: OrderedDict[BlockHash, tuple[float, int | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, prompt: PrefixKey, index: int | None = 0) -> None:
        """Remember where `prompt` (a turn's whole prompt, the `index`-th of its conversation; None: its place is
        not known) ends; not if its tokens before the last fill no block."""
        end = prompt.prompt_end(prompt.num_tokens)
        if end is None:
            return
        self._ends[end] = (self._clock() + self.ttl_s, index)
        self._ends.move_to_end(end)
        while len(self._ends) > self.max_entries:
            self._ends.popitem(last=False)

    def continues(self, key: PrefixKey) -> bool:
        """Whether `key` starts with the whole prompt of a turn remembered here."""
        return self._previous(key) is not None

    def place(self, key: PrefixKey) -> int | None:
        """The place in its conversation of a turn whose prompt is `key`: 0 if it starts with no remembered turn's
        whole prompt, one after the latest such turn's place, None where that turn's place is not known."""
        previous = self._previous(key)
        if previous is None:
            return 0
        return None if previous[1] is None else previous[1] + 1

    def _previous(self, key: PrefixKey) -> tuple[float, int | None] | None:
        """What is remembered of the latest turn whose whole prompt `key` starts with (probes its full blocks from
        the last), after forgetting expired ones."""
        ends = self._ends
        now = self._clock()
        while ends:
            oldest, (expires, _) = next(iter(ends.items()))
            if expires > now:
                break
            del ends[oldest]
        for d in range(key.num_full_blocks - 1, -1, -1) if ends else ():
            found = ends.get(key.block_hash(d))
            if found is not None:
                return found
        return None
