"""Prompt lookup on the device: each request's own text, and where its last tokens occurred before.

The lookup branch (`prompt_lookup_tokens`) proposes what followed the latest earlier occurrence of a
request's last `match` tokens in its prompt and output (prompt lookup decoding, as vLLM's n-gram
method; code and quoting repeat). Each request's last `window` tokens live in one ring buffer on the
device, so a step finds every request's continuation with a fixed number of device ops and no host
read, whatever the batch and the text length:

    text    [R, window]      each request's last tokens, oldest first (PAD before its first)
    match   [R, window - 1]  the `match` tokens ending at j equal the last `match` tokens
    latest  [R]              the largest such j (a request whose last tokens never occurred before has none)
    tokens  [R, length]      text[latest + 1 + (t mod d)], d = window - 1 - latest

The continuation copies the text after the occurrence; where that runs into the end of the text (a
period d shorter than `length`, as in "1, 2, 1, 2"), it goes on repeating the same d tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from . import constants
from .ngram import PAD, HostTokens, host_positions
from .transfer import to_device

#: Tokens of each request's text the lookup searches (its last ones): bounds the buffer
#: (max_num_seqs x this x 4 bytes, 64 MiB at 1024 requests) and a step's search work.
LOOKUP_WINDOW = 16384


class TokenHistory:
    """Every request's last `window` tokens on the device, addressed by slot, and the lookup on them.

    `tokens` [slots, window + 1] int32: a slot's text position p at column p mod window (PAD where
    nothing was written since the slot was released); the last column takes the writes of padding
    tokens. `lengths` [slots] int64: tokens seen per slot (its text length). Both are written in
    place: a step never copies the whole buffer.
    """

    def __init__(self, window: int, match: int, slots: int = 0, device: torch.device | str = "cpu") -> None:
        """window: tokens kept per request (the lookup sees only those); match: how many last tokens
        must recur (>= 1); slots: requests addressed at once (grows when a larger slot is seen)."""
        if match < 1:
            raise ValueError(f"prompt lookup needs a match of at least 1 token, got {match}")
        if window < match + 1:
            raise ValueError(f"prompt lookup window {window} cannot hold a match of {match} tokens and one after it")
        self.window, self.match, self.device = window, match, torch.device(device)
        self.tokens = torch.full((0, window + 1), PAD, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.generation = 0  # how many times the buffers were made anew (a capture reading them holds the old)
        self._grow(slots)

    def _grow(self, slots: int) -> None:
        if slots > self.tokens.shape[0]:
            self.generation += 1
            more = max(slots, 2 * self.tokens.shape[0]) - self.tokens.shape[0]
            self.tokens = torch.cat([self.tokens, self.tokens.new_full((more, self.window + 1), PAD)])
            self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(more)])

    def observe(self, slot: int, tokens: Sequence[int] | Tensor) -> None:
        """Append host `tokens` to one slot's text."""
        t = torch.as_tensor(tokens, dtype=torch.int64).flatten()
        self.observe_step([slot], to_device(t.view(1, -1), self.device))

    def observe_step(self, slots: Sequence[int], tokens: Tensor, host: HostTokens | None = None) -> Tensor:
        """One engine step's new tokens, written with no host read (`observe_host`, then `append`).

        slots [R] host ints, each once. tokens [R, K] on the device: each row's new tokens, PAD
        (negative) after its last, appended to the slot's text. `host` (optional): tokens the host
        holds for some rows (a prompt, a prefill chunk), written first: row i's
        host.token_ids[i, start:end] at its text positions start..end-1 (the slot has seen the first
        `start`). Returns the slots as a device tensor [R].
        """
        if tokens.dim() != 2 or tokens.shape[0] != len(slots):
            raise ValueError(f"tokens must be [requests={len(slots)}, K], got {tuple(tokens.shape)}")
        slots = self.observe_host(slots, host)
        self.append(slots, tokens.to(self.device))
        return slots

    def observe_host(self, slots: Sequence[int], host: HostTokens | None = None) -> Tensor:
        """The part of `observe_step` that needs the host: the slots (each once) on the device [R],
        returned, and the tokens the host holds for some rows (`host`), written."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"observe_step got a slot twice in one call: {list(slots)}")
        self._grow(max(slots, default=-1) + 1)
        slots = to_device(torch.tensor(list(slots), dtype=torch.int64), self.device)
        if host is not None:
            self._write_host(slots, host)
        return slots

    def append(self, slots: Tensor, tokens: Tensor) -> None:
        """tokens [R, K] on the device (negative after each row's last) appended to slots [R] (device,
        each once, or -1: a row padded past a batch, all of whose tokens must be negative). Fixed
        shapes and no host read, so a captured step holds it. A negative token writes the spare
        column, and a slot's length grows by an add (`index_add_`), so a padding row, addressed to slot
        0, changes nothing whatever request slot 0 is."""
        valid = tokens >= 0  # [R, K]: a prefix of each row
        slots = slots.clamp(min=0)
        rows = slots[:, None]  # [R, 1]
        columns = (self.lengths[rows] + constants.arange(tokens.shape[1], self.device)) % self.window
        columns = torch.where(valid, columns, self.window)  # padding into the spare column
        self.tokens.index_put_((rows, columns), tokens.to(torch.int32))
        self.lengths.index_add_(0, slots, valid.sum(dim=1))

    def _write_host(self, slots: Tensor, host: HostTokens) -> None:
        """Host tokens into the ring: tensor ops over all rows on the host, one write on the device
        (only each row's last `window` tokens: earlier ones would be overwritten)."""
        end = host.end.long()
        rows, row_of, position = host_positions(torch.maximum(host.start.long(), end - self.window), end)
        if row_of.numel() == 0:
            return
        values = host.token_ids[row_of, position].to(torch.int32)
        slot_of = slots[to_device(row_of, self.device)]
        self.tokens.index_put_((slot_of, to_device(position % self.window, self.device)), to_device(values, self.device))
        self.lengths.index_put_((slots[to_device(rows, self.device)],), to_device(end[rows], self.device))

    def release(self, slots: Sequence[int] | Tensor) -> None:
        """Forget finished requests' text so their slots can be reused."""
        slots = torch.as_tensor(slots, dtype=torch.int64)
        if slots.numel() == 0:
            return
        self._grow(int(slots.max()) + 1)
        slots = to_device(slots, self.device)
        self.tokens.index_put_((slots,), self.tokens.new_full((), PAD))
        self.lengths.index_put_((slots,), self.lengths.new_zeros(()))

    def continuation(self, slots: Tensor | Sequence[int], length: int) -> tuple[Tensor, Tensor]:
        """Each request's lookup path: slots [R] -> tokens [R, length] (0 where not valid), valid
        [R, length] (a whole row False where its last `match` tokens never occurred before in the
        window). Fixed shapes, no host read (module docstring)."""
        if not isinstance(slots, Tensor):  # host ints (a device tensor comes from `observe_step`)
            self._grow(max(slots, default=-1) + 1)
            slots = torch.tensor(list(slots), dtype=torch.int64)
        slots = to_device(slots, self.device)[:, None]  # [R, 1]
        h, m = self.window, self.match
        r = slots.shape[0]
        ages = constants.arange(h, self.device)  # column j of `text`: text position length - h + j
        text = self.tokens[slots, (self.lengths[slots] + ages) % h].long()  # [R, h] oldest first
        suffix = text[:, h - m :]  # [R, m] the last m tokens
        # [R, h - 1]: the m tokens ending at column j (j < h - 1: one token must follow) are the
        # suffix. PAD fills only the columns before a text's first token, so a text of 1..m-1 tokens
        # (its suffix starts with PAD) matches no earlier window; an empty one (all PAD) matches
        # every window, and is told apart by its last token.
        match = (text[:, : h - 1].unfold(1, m, 1) == suffix[:, None, :]).all(dim=2)
        ends = constants.arange(h - 1, self.device, start=m - 1)  # the windows' last columns
        latest = torch.where(match, ends, -1).max(dim=1, keepdim=True).values  # [R, 1], -1: none
        period = h - 1 - latest  # [R, 1] columns from the occurrence's end to the text's (h where none)
        at = (latest + 1) + constants.arange(length, self.device) % period  # [R, length] < h
        valid = (torch.minimum(latest, text[:, h - 1 :]) >= 0).expand(r, length)
        return torch.where(valid, text.gather(1, at), 0), valid
