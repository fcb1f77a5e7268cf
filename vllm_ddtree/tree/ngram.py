"""Prefix-aligned scoring (PRESTO): an n-gram model rho that rescores draft tokens by their path.

The drafter's marginals q_d are blind to which tokens precede a node; rho(t | previous n-1 tokens)
is not. Token score = log q_d(t) + lambda_d * log rho(t | c), lambda default 0.2, n default 3.

Counts live on the device as sorted int64 keys, so a lookup for a whole [R, F, K] candidate block is
two `searchsorted` per order (on a GPU, two for all orders' tables stacked) with no host
synchronisation. Keys pack (namespace, context tokens, token) in mixed radix (vocab + 1); when that
exceeds 63 bits (n >= 4 with a large vocabulary) it wraps and acts as a hash, which only perturbs
scores, never the target's output.

Two sources, mixed: an online table per request (namespace = the request's slot), fed with the
prompt and every committed token, which catches the repetition typical of code and quoting; and an
optional corpus table (namespace 0) loaded from a file built by `build_corpus_ngram`.

rho uses "stupid backoff" (Brants et al. 2007): the longest context seen with this token gives
count(c, t) / count(c), each back-off step multiplies by `backoff`, and a floor keeps unseen tokens
finite (log(floor)) so the rescoring never removes a candidate outright.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import Tensor

PAD = -1  # "no token" (before the start of a sequence)


def _wrap(x: int) -> int:
    """A Python int as the int64 it wraps to (torch's int64 arithmetic wraps the same way)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _search_orders_at_once(device: torch.device) -> bool:
    """Two exact ways to look the orders up, chosen by device (as `compile.ancestor_mask`): on a GPU,
    where each op is a kernel launch, all orders in one stacked search (`lookup_orders`, a fixed op
    count); elsewhere order by order (`lookup`, about as many ops per order), which looks unigrams up
    once per request and so does less work: `benchmarks/results/step_overhead.json`, which times the
    GPU's paths on 2 vCPUs, has the step with rescoring at 1.7-2.0x the per-order search's host time
    at batch 64 and 256."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=16)
def _context_powers(radix: int, orders: int, history: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The digit weights of `_pack` for contexts of 0..orders-1 tokens taken from the end of a
    `history`-token window: [orders, history] (radix^(m-1-i) on order m's i-th context token, 0 on
    the tokens before it) and [orders] the namespace's weight radix^m; int64, wrapped as _pack wraps."""
    powers = [[0] * history for _ in range(orders)]
    for m in range(orders):
        for i in range(m):
            powers[m][history - m + i] = _wrap(radix ** (m - 1 - i))
    flat = _device_ints(tuple(v for row in powers for v in row), device).view(orders, history)
    return flat, _device_ints(tuple(_wrap(radix**m) for m in range(orders)), device)


@functools.lru_cache(maxsize=64)
def _device_ints(values: tuple[int, ...], device: torch.device) -> Tensor:
    """[len(values)] int64 constants made on `device` by fills: no host-to-device copy, which from
    pageable memory would wait for the device (a host sync in the middle of a step). Made once."""
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, v in enumerate(values):
        out[i : i + 1].fill_(v)
    return out


def _pack(namespace: Tensor, tokens: Tensor, radix: int) -> Tensor:
    """namespace [...], tokens [..., m] -> int64 keys [...] (mixed radix, wrapping)."""
    key = namespace.long()
    for i in range(tokens.shape[-1]):
        key = key * radix + (tokens[..., i].long() + 1)
    return key


@dataclass
class NGramCounts:
    """Sorted n-gram count tables on one device, for orders 1..n (context lengths 0..n-1).

    ngram_keys[m] / ngram_counts[m]: keys of (namespace, m context tokens, token), sorted.
    context_keys[m] / context_counts[m]: keys of (namespace, m context tokens), sorted.
    """

    order: int
    vocab_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ngram_keys: list[Tensor] = field(default_factory=list)
    ngram_counts: list[Tensor] = field(default_factory=list)
    context_keys: list[Tensor] = field(default_factory=list)
    context_counts: list[Tensor] = field(default_factory=list)
    # the tables of orders 0..k-1 stacked for one search (`_stacked`), until the next change
    _stack: tuple | None = field(default=None, repr=False, compare=False)
    # per order, the best next token of every context (`_best_next`), until the next change
    _best: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.order < 1:
            raise ValueError(f"n-gram order must be >= 1, got {self.order}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if not self.ngram_keys:
            empty = lambda: torch.zeros(0, dtype=torch.int64, device=self.device)  # noqa: E731
            self.ngram_keys = [empty() for _ in range(self.order)]
            self.ngram_counts = [empty() for _ in range(self.order)]
            self.context_keys = [empty() for _ in range(self.order)]
            self.context_counts = [empty() for _ in range(self.order)]

    @property
    def radix(self) -> int:
        return self.vocab_size + 1

    def add(self, namespace: Tensor, windows: Tensor, longest_only: bool = False) -> None:
        """Count n-grams. windows [N, n]: n-1 context tokens (PAD where none) then the token.

        `longest_only`: count only the order-n n-grams (`ngram_keys[n-1]`, all that `follow` reads),
        not the shorter ones nor the context tables: one table merge instead of 2n.
        Merging needs `torch.unique`, which synchronises: this runs once per step, not per node.
        """
        if windows.dim() != 2 or windows.shape[1] != self.order:
            raise ValueError(f"windows must be [N, order={self.order}], got {tuple(windows.shape)}")
        windows = windows.to(self.device).long()
        namespace = namespace.to(self.device).long().expand(windows.shape[0])
        for m in [self.order - 1] if longest_only else range(self.order):  # m = context length
            ctx = windows[:, self.order - 1 - m : self.order - 1]
            # A context that reaches before the sequence start is not a real m-token context.
            real = (ctx >= 0).all(dim=1) if m > 0 else torch.ones_like(namespace, dtype=torch.bool)
            ng = _pack(namespace, windows[:, self.order - 1 - m :], self.radix)[real]
            self.ngram_keys[m], self.ngram_counts[m] = _merge(self.ngram_keys[m], self.ngram_counts[m], ng)
            if not longest_only:
                cx = _pack(namespace, ctx, self.radix)[real]
                self.context_keys[m], self.context_counts[m] = _merge(self.context_keys[m], self.context_counts[m], cx)
        self._stack = self._best = None

    def drop_namespace(self, namespace: int) -> None:
        """Forget every count of one namespace (a finished request's slot). Exact while keys don't wrap."""
        self.drop_namespaces([namespace])

    def drop_namespaces(self, namespaces: Sequence[int]) -> None:
        """Forget every count of these namespaces, in one pass over each table."""
        drop = torch.tensor(list(namespaces), dtype=torch.int64, device=self.device)
        for m in range(self.order):
            span_ng = self.radix ** (m + 1)
            span_cx = self.radix**m
            self.ngram_keys[m], self.ngram_counts[m] = _drop(self.ngram_keys[m], self.ngram_counts[m], drop, span_ng)
            self.context_keys[m], self.context_counts[m] = _drop(
                self.context_keys[m], self.context_counts[m], drop, span_cx
            )
        self._stack = self._best = None

    def lookup(self, namespace: Tensor, history: Tensor, tokens: Tensor, m: int) -> tuple[Tensor, Tensor]:
        """count(c_m, t) [R, F, K] and count(c_m) [R, F] for the last m tokens of history [R, F, n-1].

        A context reaching before the sequence start (a PAD digit, 0) is never counted at its order
        (`add` skips it and real tokens pack as digits >= 1), so its keys simply miss: no mask needed.
        """
        r, f, _ = tokens.shape
        if m == 0 and f > 1 and tokens.stride(1) == 0:
            # Unigram counts do not depend on the history: when every frontier node has the same
            # candidates (the tree build passes them expanded), look them up once per request.
            ng, cx = self.lookup(namespace, history[:, :1], tokens[:, :1], 0)
            return ng.expand(r, f, -1), cx.expand(r, f)
        ns = namespace.to(self.device).long().view(r, 1).expand(r, f)
        ctx = history[:, :, history.shape[2] - m :] if m > 0 else history[:, :, :0]
        # The context part of a key is shared by a frontier node's K candidates: pack and look it up
        # once per node; the n-gram key appends the token (the same mixed-radix arithmetic as _pack).
        cx_key = _pack(ns, ctx, self.radix)  # [R, F]
        ng_key = cx_key[:, :, None] * self.radix + (tokens.long() + 1)  # [R, F, K]
        ng = _find(self.ngram_keys[m], self.ngram_counts[m], ng_key)
        cx = _find(self.context_keys[m], self.context_counts[m], cx_key)
        return ng, cx

    def lookup_orders(self, namespace: Tensor, history: Tensor, tokens: Tensor, orders: int) -> tuple[Tensor, Tensor]:
        """`lookup` for m = 0 .. orders-1 at once: count(c_m, t) [orders, R, F, K] and count(c_m)
        [orders, R, F], c_m the last m tokens of history [R, F, h] (h >= orders - 1).

        Two `searchsorted` whatever the order (a fixed op count; `lookup` takes about as many per
        order): the n-gram tables of all orders stacked, then their context tables (`_stacked`); this
        runs at every depth of a rescored build. A context reaching before the sequence start (a PAD
        digit, 0) is never counted at its order (`add` skips it and real tokens pack as digits >= 1),
        so its keys simply miss: no mask needed.
        """
        r, f, k = tokens.shape
        powers, ns_powers = _context_powers(self.radix, orders, history.shape[2], self.device)
        digits = history.to(self.device).long() + 1  # [R, F, h]
        ns = namespace.to(self.device).long().view(1, r, 1)
        # order m's context key: the same mixed-radix arithmetic as _pack, on the last m digits
        cx = (digits[None] * powers[:, None, None, :]).sum(dim=3) + ns * ns_powers[:, None, None]  # [orders, R, F]
        ng = cx[..., None] * self.radix + (tokens.to(self.device).long()[None] + 1)  # [orders, R, F, K]
        ng_keys, ng_counts, cx_keys, cx_counts = self._stacked(orders)
        return _find_rows(ng_keys, ng_counts, ng), _find_rows(cx_keys, cx_counts, cx)

    def _stacked(self, orders: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """[orders, L] keys and counts of the n-gram tables of orders 0..orders-1, then the same of their
        context tables, each padded to its group's longest with keys past any query (count 0). Made
        once per change of the tables."""
        if self._stack is None or self._stack[0] != orders:
            last = torch.iinfo(torch.int64).max

            def stack(tables: list[Tensor], counts: list[Tensor]) -> tuple[Tensor, Tensor]:
                width = max(t.numel() for t in tables)  # padded by cat: the same ops whatever the sizes
                return (torch.stack([torch.cat([t, t.new_full((width - t.numel(),), last)]) for t in tables]),
                        torch.stack([torch.cat([c, c.new_zeros(width - c.numel())]) for c in counts]))

            self._stack = (orders, *stack(self.ngram_keys[:orders], self.ngram_counts[:orders]),
                           *stack(self.context_keys[:orders], self.context_counts[:orders]))
        return self._stack[1:]

    def follow(self, namespace: Tensor, context: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """`length` times: the most counted token after the last m tokens, appended to them.

        namespace [R], context [R, m] (m < order; a PAD makes the context unseen) -> tokens [R, length]
        (0 where not valid), valid [R, length]: a step whose context was never seen followed by anything
        is invalid, and so is every step after it. Ties go to the smallest token id. Where keys wrap
        (see module docstring) the answer is arbitrary, never wrong output: it is a draft.

        One `searchsorted` finds the context, then each step is two gathers in the table of best next
        tokens (`_best_next`, made once per change of the tables): the token, and the context it makes.
        About 40 device ops for 8 steps (and about 45 to remake the table after a merge), no host
        synchronisation: this runs on every engine step with a lookup branch. Where keys of this order
        can wrap (radix^(m+1) past 63 bits, see the module docstring) a key has no context part to
        divide out: `_follow_by_search` then searches each step's context among the n-gram keys.
        """
        r, m = context.shape
        if self.ngram_keys[m].numel() == 0 or length == 0:
            return (torch.zeros(r, length, dtype=torch.int64, device=self.device),
                    torch.zeros(r, length, dtype=torch.bool, device=self.device))
        if self.radix ** (m + 1) >= 1 << 63:  # keys of this order wrap: no context part to divide out
            return self._follow_by_search(namespace, context, length)
        contexts, best_digit, next_entry = self._best_next(m)
        none = contexts.numel()  # the tables' last entry: no token, and no context after it
        digits = context.to(self.device).long() + 1  # [R, m]; PAD -> digit 0, never in the tables
        ns_key = namespace.to(self.device).long() * _wrap(self.radix**m)  # the key's namespace part, as _pack
        powers = _device_ints(tuple(_wrap(self.radix**i) for i in range(m - 1, -1, -1)), self.device)
        cx = ns_key + (digits * powers).sum(dim=1)  # = _pack(namespace, context)
        at = torch.searchsorted(contexts, cx).clamp_(max=none - 1)
        at = torch.where(contexts[at] == cx, at, none)  # [R] the context's entry
        found = []
        for _ in range(length):
            found.append(best_digit[at])  # the next token's digit (token + 1), 0 where none follows
            at = next_entry[at]
        found = torch.stack(found, dim=1)  # [R, length]
        seen = (context >= 0).all(dim=1).to(self.device)[:, None]
        valid = ((found > 0) & seen).int().cumprod(dim=1).bool()
        return torch.where(valid, found - 1, 0), valid

    def _follow_by_search(self, namespace: Tensor, context: Tensor, length: int, window: int = 16
                          ) -> tuple[Tensor, Tensor]:
        """`follow` where keys wrap: each step packs its context's key with the tables' own wrapping
        arithmetic and searches both ends of that context's key range; the first `window` keys of
        the range (by token id) are compared, a fixed shape. About 23 device ops a step."""
        r, m = context.shape
        keys, counts = self.ngram_keys[m], self.ngram_counts[m]
        radix, last = self.radix, keys.numel() - 1
        digits = context.to(self.device).long() + 1  # [R, m]; PAD -> digit 0, never in the tables
        ns_key = namespace.to(self.device).long() * _wrap(radix**m)  # the key's namespace part, as _pack makes it
        powers = _device_ints(tuple(_wrap(radix**i) for i in range(m - 1, -1, -1)), self.device)
        ends = _device_ints((1, radix), self.device)  # token digits are 1..vocab
        win = torch.arange(window, device=self.device)
        found, hits = [], []
        for _ in range(length):
            cx = ns_key + (digits * powers).sum(dim=1)  # = _pack(namespace, context), wrapping alike
            bounds = torch.searchsorted(keys, (cx * radix)[:, None] + ends)  # [R, 2]: the context's key range
            idx = bounds[:, :1] + win  # [R, window]
            at = idx.clamp(max=last)
            cand = counts[at] * (idx < bounds[:, 1:])
            count, best = cand.max(dim=1, keepdim=True)  # first of equal counts: the smallest token id
            token = keys[at.gather(1, best)] % radix - 1  # [R, 1]
            found.append(token)
            hits.append(count > 0)
            digits = torch.cat([digits[:, 1:], token + 1], dim=1)
        seen = (context >= 0).all(dim=1).to(self.device)[:, None]
        valid = (torch.cat(hits, dim=1) & seen).int().cumprod(dim=1).bool()
        return torch.where(valid, torch.cat(found, dim=1), 0), valid

    def _best_next(self, m: int) -> tuple[Tensor, Tensor, Tensor]:
        """The order-(m+1) table as a chain to follow: every context key seen followed by a token, sorted
        [L] (padded with keys past any query); per entry, with one more entry (L: none) at the end,
        the digit (token + 1) of its most counted next token [L + 1] (the smallest token among equal
        counts; 0: none) and the entry of the context that token makes [L + 1] (L where never seen
        followed). Only for orders whose keys cannot wrap (see `follow`).

        A segmented argmax over the sorted n-gram keys, whose (namespace, context) part is the key
        divided by the radix (a floor division: monotone, so still sorted), then one search for the
        shifted contexts. Fixed shapes (L = the table's length), no host synchronisation; made once
        per change of the tables."""
        if self._best is not None and m in self._best:
            return self._best[m]
        keys, counts = self.ngram_keys[m], self.ngram_counts[m]
        n, radix = keys.numel(), self.radix
        context = torch.div(keys, radix, rounding_mode="floor")
        starts = torch.ones(n, dtype=torch.bool, device=keys.device)
        starts[1:] = context[1:] != context[:-1]
        group = starts.cumsum(0) - 1  # [L] the context's rank
        most = torch.zeros_like(counts).scatter_reduce_(0, group, counts, "amax")
        index = torch.arange(n, device=keys.device)
        first = torch.full_like(index, n).scatter_reduce_(0, group, torch.where(counts == most[group], index, n), "amin")
        contexts = torch.full_like(keys, torch.iinfo(torch.int64).max).scatter_(0, group, context)
        digit = torch.where(first < n, keys[first.clamp(max=n - 1)] % radix, 0)  # [L]
        # the context after the token: the oldest digit shifted out, the token's shifted in
        span = radix**m
        namespace = torch.div(contexts, span, rounding_mode="floor")
        shifted = namespace * span + (contexts - namespace * span) % (span // radix) * radix + digit
        after = torch.searchsorted(contexts, shifted).clamp_(max=n - 1)
        after = torch.where((contexts[after] == shifted) & (digit > 0), after, n)
        none = torch.full((1,), n, dtype=torch.int64, device=keys.device)
        self._best = (self._best or {}) | {m: (contexts, torch.cat([digit, none * 0]), torch.cat([after, none]))}
        return self._best[m]

    def save(self, path: str | Path) -> None:
        """Write the tables as safetensors (metadata: order, vocab_size)."""
        from safetensors.torch import save_file

        tensors = {}
        for m in range(self.order):
            tensors[f"ngram_keys.{m}"] = self.ngram_keys[m].cpu()
            tensors[f"ngram_counts.{m}"] = self.ngram_counts[m].cpu()
            tensors[f"context_keys.{m}"] = self.context_keys[m].cpu()
            tensors[f"context_counts.{m}"] = self.context_counts[m].cpu()
        save_file(tensors, str(path), metadata={"order": str(self.order), "vocab_size": str(self.vocab_size)})

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> "NGramCounts":
        """Read tables written by `save`."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"corpus n-gram file {path} does not exist; build it with `vllm-ddtree build-ngram`")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if "order" not in meta or "vocab_size" not in meta:
                raise ValueError(f"{path} is not an n-gram table written by vllm-ddtree (no order/vocab_size metadata)")
            order, vocab = int(meta["order"]), int(meta["vocab_size"])
            get = lambda name: f.get_tensor(name)  # noqa: E731
            return cls(
                order=order,
                vocab_size=vocab,
                device=torch.device(device),
                ngram_keys=[get(f"ngram_keys.{m}") for m in range(order)],
                ngram_counts=[get(f"ngram_counts.{m}") for m in range(order)],
                context_keys=[get(f"context_keys.{m}") for m in range(order)],
                context_counts=[get(f"context_counts.{m}") for m in range(order)],
            )


def _merge(keys: Tensor, counts: Tensor, new_keys: Tensor) -> tuple[Tensor, Tensor]:
    if new_keys.numel() == 0:
        return keys, counts
    all_keys = torch.cat([keys, new_keys])
    all_counts = torch.cat([counts, torch.ones_like(new_keys)])
    uniq, inverse = torch.unique(all_keys, sorted=True, return_inverse=True)
    merged = torch.zeros_like(uniq).scatter_add_(0, inverse, all_counts)
    return uniq, merged


def _drop(keys: Tensor, counts: Tensor, namespaces: Tensor, span: int) -> tuple[Tensor, Tensor]:
    keep = ~torch.isin(torch.div(keys, span, rounding_mode="floor"), namespaces)
    return keys[keep], counts[keep]


def _find(keys: Tensor, counts: Tensor, query: Tensor) -> Tensor:
    """Counts [...] of the keys `query` [...] in one sorted table keys/counts [L] (0 where absent)."""
    return _find_rows(keys[None], counts[None], query[None])[0]


def _find_rows(keys: Tensor, counts: Tensor, query: Tensor) -> Tensor:
    """`_find` for stacked tables: keys/counts [T, L] (each row sorted), query [T, ...] -> counts [T, ...]."""
    if keys.shape[1] == 0:
        return torch.zeros_like(query)
    flat = query.reshape(query.shape[0], -1)
    idx = torch.searchsorted(keys, flat).clamp_(max=keys.shape[1] - 1)
    return torch.where(keys.gather(1, idx) == flat, counts.gather(1, idx), 0).view_as(query)


def windows_of(tokens: Sequence[int] | Tensor, order: int, history: Sequence[int] | Tensor = ()) -> Tensor:
    """Every n-gram window [N, n] ending at each of `tokens`, with `history` (earlier tokens) as context."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64).flatten()
    hist = torch.as_tensor(history, dtype=torch.int64).flatten()[-(order - 1) :] if order > 1 else torch.zeros(0)
    hist = hist.long()
    pad = torch.full((order - 1 - hist.numel(),), PAD, dtype=torch.int64)
    seq = torch.cat([pad, hist, tokens])
    return seq.unfold(0, order, 1)[-tokens.numel() :] if tokens.numel() else torch.zeros(0, order, dtype=torch.int64)


class NGramModel:
    """Online per-request n-gram counts (+ optional corpus table) that score draft tokens.

    One instance serves a whole engine: requests are addressed by slot (0 <= slot < max_slots).
    `observe` feeds committed tokens; `scorer(slots)` gives the `PrefixScorer` for one build.
    """

    def __init__(
        self,
        vocab_size: int,
        order: int = 3,
        *,
        floor: float = 1e-4,
        backoff: float = 0.4,
        corpus: NGramCounts | str | Path | None = None,
        corpus_weight: float = 0.5,
        device: torch.device | str = "cpu",
        scoring: bool = True,
    ) -> None:
        """`scoring` False keeps only the counts `continuation` (the lookup branch) reads, the order-n
        n-grams, for an engine that does not rescore: one table merge per step instead of 2n (6 at
        order 3); `scorer` and `log_rho` then raise."""
        if order < 2:
            raise ValueError(f"n-gram order must be >= 2 (a context of at least one token), got {order}")
        if not 0 < floor <= 1:
            raise ValueError(f"n-gram floor must be in (0, 1], got {floor}")
        if not 0 < backoff <= 1:
            raise ValueError(f"n-gram backoff must be in (0, 1], got {backoff}")
        if not 0 <= corpus_weight <= 1:
            raise ValueError(f"corpus_weight must be in [0, 1], got {corpus_weight}")
        self.device = torch.device(device)
        self.order = order
        self.vocab_size = vocab_size
        self.floor = floor
        self.backoff = backoff
        self.online = NGramCounts(order, vocab_size, self.device)
        if isinstance(corpus, (str, Path)):
            corpus = NGramCounts.load(corpus, self.device)
        if corpus is not None:
            if corpus.vocab_size != vocab_size:
                raise ValueError(
                    f"corpus n-gram table was built for vocab {corpus.vocab_size}, the model has {vocab_size}; "
                    "rebuild it with the target's tokenizer"
                )
            if corpus.order < order:
                raise ValueError(f"corpus n-gram table has order {corpus.order} < requested order {order}")
        self.corpus = corpus
        self.corpus_weight = corpus_weight if corpus is not None else 0.0
        self._tails: dict[int, list[int]] = {}
        self.scoring = scoring
        if not scoring and corpus is not None:
            raise ValueError("a corpus n-gram table only serves rescoring: pass scoring=True with it")

    def observe(self, slot: int, tokens: Sequence[int] | Tensor) -> None:
        """Count the n-grams that `tokens` (appended to the slot's sequence so far) complete."""
        self.observe_batch([slot], [tokens])

    def observe_batch(self, slots: Sequence[int], tokens: Sequence[Sequence[int] | Tensor]) -> None:
        """`observe` for many requests at once: tokens[i] is appended to slots[i]'s sequence.

        One merge of the count tables per step, not one per request: a merge is a `torch.unique`
        over the whole table (a host synchronisation on a GPU), and per request its cost grew with
        the batch times the table size.
        """
        if len(slots) != len(tokens):
            raise ValueError(f"observe_batch needs one token list per slot, got {len(slots)} slots and {len(tokens)} lists")
        if len(set(slots)) != len(slots):
            raise ValueError(f"observe_batch got a slot twice in one call: {list(slots)}")
        wins, namespaces = [], []
        for slot, toks in zip(slots, tokens):
            toks = torch.as_tensor(toks, dtype=torch.int64).flatten()
            if toks.numel() == 0:
                continue
            tail = self._tails.get(slot, [])
            wins.append(windows_of(toks, self.order, tail))
            namespaces.append(torch.full((toks.numel(),), slot, dtype=torch.int64))
            self._tails[slot] = (tail + toks.tolist())[-(self.order - 1) :]
        if wins:
            self.online.add(torch.cat(namespaces), torch.cat(wins), longest_only=not self.scoring)

    def release(self, slot: int) -> None:
        """Forget a finished request's counts so its slot can be reused."""
        self.release_batch([slot])

    def release_batch(self, slots: Sequence[int]) -> None:
        """`release` for many finished requests: one filter pass over the tables."""
        if not slots:
            return
        self.online.drop_namespaces(list(slots))
        for slot in slots:
            self._tails.pop(slot, None)

    def context_tail(self, slots: Sequence[int]) -> Tensor:
        """[R, n-1] last committed tokens per slot (PAD-filled on the left), for `build_tree`."""
        rows = []
        for s in slots:
            tail = self._tails.get(s, [])
            rows.append([PAD] * (self.order - 1 - len(tail)) + tail)
        return torch.tensor(rows, dtype=torch.int64, device=self.device).view(len(rows), self.order - 1)

    def log_rho(self, slots: Tensor, history: Tensor, tokens: Tensor) -> Tensor:
        """log rho(t | history) [R, F, K] for the requests in `slots` [R]; no host synchronisation."""
        if not self.scoring:
            raise ValueError("this NGramModel keeps only the lookup branch's counts (scoring=False); "
                             "make it with scoring=True to rescore draft trees")
        rho = (1.0 - self.corpus_weight) * self._backoff(self.online, slots, history, tokens)
        if self.corpus is not None:
            zero = torch.zeros_like(slots)
            rho = rho + self.corpus_weight * self._backoff(self.corpus, zero, history, tokens)
        return torch.log(rho.clamp(min=self.floor))

    def _backoff(self, counts: NGramCounts, slots: Tensor, history: Tensor, tokens: Tensor) -> Tensor:
        # The longest context with count(c, t) > 0 decides; each step down costs a factor `backoff`.
        # Shortest context first, so a longer context's hit overwrites (few ops: this runs per depth).
        rho = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        if not _search_orders_at_once(tokens.device):
            for m in range(self.order):
                ng, cx = counts.lookup(slots, history, tokens, m)
                ratio = ng.float() / cx.clamp(min=1).float()[:, :, None]
                rho = torch.where(ng > 0, ratio * self.backoff ** (self.order - 1 - m), rho)
            return rho
        ng, cx = counts.lookup_orders(slots, history, tokens, self.order)  # [order, R, F, K], [order, R, F]
        ratio = ng.float() / cx.clamp(min=1).float()[..., None]
        for m in range(self.order):
            rho = torch.where(ng[m] > 0, ratio[m] * self.backoff ** (self.order - 1 - m), rho)
        return rho

    def continuation(self, slots: Sequence[int] | Tensor, context_tail: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """Prompt lookup from the online counts: each request's likeliest next `length` tokens.

        From the last n-1 committed tokens (`context_tail` [R, n-1], root last), repeatedly take the
        token most often seen after the last n-1 tokens in the request's own prompt and output, as
        code and quoting repeat; it stops (valid False from there on) at a context never seen
        followed by anything. slots [R] -> tokens [R, length] (0 where not valid), valid [R, length].
        Batched on the device, `length` table lookups, no host synchronisation.
        """
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        n1 = self.order - 1
        return self.online.follow(slots, context_tail[:, context_tail.shape[1] - n1 :], length)

    def scorer(self, slots: Sequence[int] | Tensor) -> "NGramScorer":
        """The `PrefixScorer` for a build over the requests in `slots` (row r = slots[r])."""
        if not self.scoring:
            raise ValueError("this NGramModel keeps only the lookup branch's counts (scoring=False); "
                             "make it with scoring=True to rescore draft trees")
        return NGramScorer(self, torch.as_tensor(slots, dtype=torch.int64, device=self.device))


@dataclass
class NGramScorer:
    """`PrefixScorer` view of an `NGramModel` bound to one batch's slots."""

    model: NGramModel
    slots: Tensor

    @property
    def order(self) -> int:
        return self.model.order

    def log_rho(self, history: Tensor, tokens: Tensor, rows: Tensor | None = None) -> Tensor:
        slots = self.slots if rows is None else self.slots[rows]
        return self.model.log_rho(slots, history, tokens)


def entropy_adaptive_lambda(log_probs: Tensor, beta: float = 0.4, c: float = 1.0) -> Tensor:
    """PRESTO's entropy-adaptive weight lambda_d = beta * H_d / (H_d + c) per request and depth.

    log_probs [R, L, V] (or the top-K slice, which gives a lower bound of the entropy) -> [R, L].
    A confident drafter (low entropy) leans on its own marginal; an unsure one on the n-gram.
    """
    if beta < 0 or c <= 0:
        raise ValueError(f"entropy-adaptive lambda needs beta >= 0 and c > 0, got beta={beta}, c={c}")
    p = log_probs.float().exp()
    ent = -(p * torch.where(p > 0, log_probs.float(), 0.0)).sum(dim=-1)
    return beta * ent / (ent + c)


def build_corpus_ngram(
    texts: Iterable[str], tokenizer, order: int = 3, vocab_size: int | None = None, chunk: int = 256
) -> NGramCounts:
    """Count the n-grams of `texts` tokenized with the target's tokenizer into a corpus table."""
    vocab_size = vocab_size or len(tokenizer)
    table = NGramCounts(order, vocab_size)
    batch: list[Tensor] = []
    pending = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        batch.append(windows_of(ids, order))
        pending += len(ids)
        if pending >= chunk * 1024:
            table.add(torch.tensor(0), torch.cat(batch))
            batch, pending = [], 0
    if batch:
        table.add(torch.tensor(0), torch.cat(batch))
    return table

