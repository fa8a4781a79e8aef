"""What the recent turns say of the workload: how many more turns a conversation brings after a turn at its place,
and how many tokens a turn decodes. The planner prices both into a placement (how long a turn keeps its target busy,
and the later turns that follow it there)."""

from __future__ import annotations

from collections import deque


class WorkloadForecast:
    """Learned from the turns the ingress runs (`observe_turn`, `observe_output` mutate); read by the planner."""

    # The most later turns of a conversation priced into a placement.
    MAX_FUTURE_TURNS = 8.0
    # Recent turns whose places in their conversations tell how many more turns to expect.
    TURN_WINDOW = 256
    MIN_PLACED_TURNS = 16

    def __init__(self) -> None:
        # Completion tokens of recent turns (a moving average): how long a turn typically decodes.
        self.typical_output_tokens: float | None = None
        # Each recent turn's index in its conversation (0: a first turn; None: a continuation whose place is not
        # known): how many more turns a turn's conversation will bring to wherever it runs (`expected_future_turns`).
        self._turn_index: deque[int | None] = deque(maxlen=self.TURN_WINDOW)

    def expected_future_turns(self, index: int | None = None) -> float:
        """How many more turns a conversation brings after its `index`-th (0: its first), at most MAX_FUTURE_TURNS.

        Each conversation leaves one turn at every index it reaches, so among recent turns, those at indices above
        `index` per turn at `index` is how many more a conversation that got this far went on to bring. A
        conversation's last turn brings none: priced as if it went on like an average one, the last turns of
        long conversations pulled their 3.5k-token histories to the busier engine for turns that never came
        (a long-history multi-turn run, commit 64aa5ff: eight pulls, 370-505 ms against ~250 for
        staying). Without `index`, or before MIN_PLACED_TURNS turns of known place: from the share c of turns that
        continue a conversation, as if every turn were as likely to be the last: with conversations of T turns on
        average, c = (T - 1) / T, so T - 1 = c / (1 - c). One-shot traffic (c = 0) brings none."""
        if index is not None and self.knows_future:
            placed = [i for i in self._turn_index if i is not None]
            here = sum(1 for i in placed if i == index)
            beyond = sum(1 for i in placed if i > index)
            return min(self.MAX_FUTURE_TURNS, beyond / max(1, here))
        share = min(self.continuation_share, self.MAX_FUTURE_TURNS / (1 + self.MAX_FUTURE_TURNS))
        return share / (1 - share)

    @property
    def knows_future(self) -> bool:
        """Whether enough turns of known place have been seen to tell how many more a conversation brings after a
        turn at its place (`expected_future_turns`); before that, the forecast is a guess from few turns or none."""
        return sum(1 for i in self._turn_index if i is not None) >= self.MIN_PLACED_TURNS

    @property
    def continuation_share(self) -> float:
        """The share of recent turns that continued a conversation (0 before any was seen)."""
        turns = self._turn_index
        return sum(1 for i in turns if i != 0) / len(turns) if turns else 0.0

    def expected_output_tokens(self, max_tokens: int) -> int:
        """How many tokens a turn allowed `max_tokens` will decode: recent turns' average, at most `max_tokens`."""
        typical = self.typical_output_tokens
        return max(1, min(max_tokens, round(typical) if typical is not None else max_tokens))

    def observe_output(self, completion_tokens: int) -> None:
        """A finished turn's completion length (mutates the moving average)."""
        if completion_tokens > 0:
            prev = self.typical_output_tokens
            self.typical_output_tokens = completion_tokens if prev is None else 0.9 * prev + 0.1 * completion_tokens

    def observe_turn(self, index: int | None) -> None:
        """A planned turn and its index in its conversation: 0 for a first turn, None for a continuation whose place
        is not known (mutates the window of recent turns)."""
        self._turn_index.append(index)
