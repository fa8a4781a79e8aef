"""The ingress's memory of where recent prompts ended: continuations recognised after their holds expired."""

from __future__ import annotations

from app.recent_prompts import RecentPrompts
from kvtransfer.prefix_key import PrefixKey, Scope

BLOCK = 16
TENANT = Scope("model", "tenant-a")


def key(tokens: list[int], scope: Scope = TENANT) -> PrefixKey:
    return PrefixKey.build(tokens, scope, BLOCK)


def test_a_turn_that_starts_with_an_earlier_prompt_continues_it_until_the_memory_expires():
    now = [0.0]
    recent = RecentPrompts(ttl_s=600, clock=lambda: now[0])
    system = list(range(1000, 1200))  # a 200-token system prompt every conversation shares
    first = system + list(range(5000, 5700))
    recent.add(key(first))
    # 30 s later (the directory's hold long gone) the next turn resends the prompt, the reply (its last prompt token
    # merged with the reply's first: a re-tokenized template) and a new message.
    now[0] = 30.0
    second = first[:-1] + [7, 8, 9] + list(range(9000, 9100))
    assert recent.continues(key(second))
    # A new conversation sharing only the system prompt, the same conversation under another tenant, and a prompt
    # that is the first one cut short do not.
    assert not recent.continues(key(system + list(range(6000, 6700))))
    assert not recent.continues(key(second, Scope("model", "tenant-b")))
    assert not recent.continues(key(first[:400]))
    # Past its time, the conversation counts as new, and the memory is emptied.
    now[0] = 601.0
    assert not recent.continues(key(second))
    assert len(recent) == 0


def test_the_memory_is_bounded_and_drops_the_oldest_prompts_first():
    recent = RecentPrompts(max_entries=3, clock=lambda: 0.0)
    prompts = [list(range(i * 1000, i * 1000 + 100)) for i in range(5)]
    for p in prompts:
        recent.add(key(p))
    assert len(recent) == 3
    assert [recent.continues(key(p + [1, 2, 3])) for p in prompts] == [False, False, True, True, True]
    # A prompt whose tokens before its last do not fill a block marks nothing.
    short = RecentPrompts(clock=lambda: 0.0)
    short.add(key(list(range(16))))
    assert len(short) == 0
    short.add(key(list(range(17))))
    assert len(short) == 1


def test_each_turn_knows_its_place_in_its_conversation():
    recent = RecentPrompts(clock=lambda: 0.0)
    system = list(range(1000, 1200))
    prompt = system + list(range(5000, 5300))
    assert recent.place(key(prompt)) == 0  # a first turn
    recent.add(key(prompt), 0)
    for index in range(1, 4):
        prompt = prompt + list(range(9000 + 100 * index, 9050 + 100 * index))  # the reply and a new message
        assert recent.place(key(prompt)) == index
        recent.add(key(prompt), index)
    # Another conversation with the same system prompt starts at 0; a continuation whose place is not known (the
    # previous turn ran through another ingress) passes that on.
    other = system + list(range(6000, 6300))
    assert recent.place(key(other)) == 0
    recent.add(key(other), None)
    assert recent.continues(key(other + [1, 2, 3])) and recent.place(key(other + [1, 2, 3])) is None
