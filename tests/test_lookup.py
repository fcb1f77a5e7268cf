"""The prompt-lookup branch's token history (tree/lookup.py) against the lookup in plain Python."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_ddtree.tree import HostTokens, TokenHistory


def lookup_in_python(text: list[int], match: int, length: int) -> list[int] | None:
    """The continuation of the latest earlier occurrence of the last `match` tokens of `text`, the
    tokens after it repeated where they run into the end; None where they never occurred before."""
    n = len(text)
    if n < match + 1:
        return None
    suffix = text[n - match :]
    for end in range(n - 2, match - 2, -1):  # the occurrence's last token; one token must follow it
        if text[end - match + 1 : end + 1] == suffix:
            period = n - 1 - end
            return [text[end + 1 + t % period] for t in range(length)]
    return None


def continuations(history: TokenHistory, slots: list[int], length: int) -> list[list[int] | None]:
    tokens, valid = history.continuation(slots, length)
    assert all(v.all() or not v.any() for v in valid)  # a whole path, or none
    assert (tokens[~valid] == 0).all()
    return [t.tolist() if v.all() else None for t, v in zip(tokens, valid)]


def test_continuation_copies_what_followed_the_latest_occurrence():
    history = TokenHistory(64, 2)
    # Slot 0: (7, 8) was followed by 9, then 10; its text ends in (7, 8) again: the latest (10 ...) wins.
    history.observe(0, [5, 6, 7, 8, 9, 1, 2, 7, 8, 10, 11, 12, 13, 7, 8])
    history.observe(1, [1, 2, 3])
    assert continuations(history, [0, 1], 4) == [[10, 11, 12, 13], None]  # (2, 3) never occurred before
    # Where the copy runs into the end of the text it goes round the same tokens again.
    history.observe(1, [4, 2, 3])
    assert continuations(history, [1], 7) == [[4, 2, 3, 4, 2, 3, 4]]
    # A slot's text is its own, and a text shorter than the match has no continuation.
    history.observe(2, [7])
    assert continuations(history, [2, 3], 3) == [None, None]
    # Released, a slot forgets its text.
    history.release([1])
    assert continuations(history, [1], 3) == [None]
    history.observe(1, [2, 3, 9, 2, 3])
    assert continuations(history, [1], 2) == [[9, 2]]


def test_the_lookup_sees_the_last_window_tokens_only():
    history = TokenHistory(8, 2)
    history.observe(0, [1, 2, 42] + list(range(10, 15)))
    assert continuations(history, [0], 2) == [None]  # the text so far ends in (13, 14)
    history.observe(0, [1, 2])  # text: 1 2 42 10 11 12 13 14 1 2; the window holds from 42 on
    assert continuations(history, [0], 2) == [None]
    wider = TokenHistory(16, 2)
    wider.observe(0, [1, 2, 42] + list(range(10, 15)) + [1, 2])
    assert continuations(wider, [0], 2) == [[42, 10]]


@pytest.mark.parametrize("window,match", [(6, 1), (16, 2), (64, 3)])
def test_batched_steps_equal_the_lookup_in_python(window, match):
    # Random steps as an engine makes them: a few slots at a time, each with a padded row of new
    # tokens (some none), prompts from the host for some rows, slots released and reused; small
    # vocabularies, so that matches, ties and the ring's wrap all happen.
    rng = random.Random(window)
    history = TokenHistory(window, match)
    texts: dict[int, list[int]] = {s: [] for s in range(5)}
    found = 0
    for step in range(60):
        slots = rng.sample(range(5), rng.randint(1, 5))
        new = [[rng.randrange(4) for _ in range(rng.randint(0, 5))] for _ in slots]
        block = torch.full((len(slots), max(map(len, new))), -1, dtype=torch.int64)
        for i, t in enumerate(new):
            block[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        host = None
        if step % 3 == 0:  # host tokens (a prompt or a chunk) for every other row, before the step's
            host = HostTokens.from_lists([(texts[s], [rng.randrange(4) for _ in range(rng.randint(1, 2 * window))])
                                          if i % 2 == 0 else None for i, s in enumerate(slots)])
            for i, s in enumerate(slots):
                texts[s] += host.token_ids[i, int(host.start[i]) : int(host.end[i])].tolist()
        for s, t in zip(slots, new):
            texts[s] += t
        history.observe_step(slots, block, host)
        if step % 7 == 6:
            gone = rng.sample(range(5), 2)
            history.release(gone)
            for s in gone:
                texts[s] = []
        ask = rng.sample(range(6), 4)  # slot 5 is never written
        want = [lookup_in_python(texts.get(s, [])[-window:], match, 9) for s in ask]
        assert continuations(history, ask, 9) == want
        found += sum(w is not None for w in want)
    assert 20 < found < 200  # both cases, many times


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="at least 1 token"):
        TokenHistory(16, 0)
    with pytest.raises(ValueError, match="window 2 cannot hold a match of 2"):
        TokenHistory(2, 2)
    history = TokenHistory(16, 2)
    with pytest.raises(ValueError, match="twice"):
        history.observe_step([0, 0], torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[requests=2, K\]"):
        history.observe_step([0, 1], torch.zeros(3, 1, dtype=torch.int64))
