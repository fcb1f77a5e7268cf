"""Prefix-aligned scoring (PRESTO): an n-gram model rho that rescores draft tokens by their path.

The drafter's marginals q_d are blind to which tokens precede a node; rho(t | previous n-1 tokens)
is not. Token score = log q_d(t) + lambda_d * log rho(t | c), lambda default 0.2, n default 3.

Counts live on the device as sorted int64 keys, so a lookup for a whole [R, F, K] candidate block is
two `searchsorted` per order (on a GPU, two for all orders' tables stacked) with no host
synchronisation. Adding counts is a sort of the table with the new keys, also without a host read:
a table may end in `KEY_PAD` entries (count 0, past any query), cut off at a later change once the
device has told the host how many keys are real (`to_host_later`). Keys pack (namespace, context tokens, token) in mixed radix (vocab + 1); when that
exceeds 63 bits (n >= 4 with a large vocabulary) it wraps and acts as a hash, which only perturbs
scores, never the target's output.

With `fixed_shape` (what a captured tree step reads: CUDA graphs hold addresses and shapes) every
table keeps one capacity, its real keys first and `KEY_PAD` after them, and each change is written into
it in place; the host grows the capacity (doubling; a new `generation`, so captures keyed by it are
made anew) when an upper bound of the real keys, known without a host read, would pass it.

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

from .constants import device_ints
from .transfer import HostLater, to_device, to_host_later

PAD = -1  # "no token" (before the start of a sequence)
KEY_PAD = torch.iinfo(torch.int64).max  # a table's padding: a key past any query, count 0


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


def _merge_orders_at_once(device: torch.device) -> bool:
    """Two exact ways to count a step's windows into the tables, chosen by device (as
    `_search_orders_at_once`): on a GPU, every order's n-gram and context table in one batched
    merge (`_add_orders_at_once`: a fixed op count, the tables padded to one length); elsewhere table
    by table (`_merge`, about as many ops per table), which sorts no padding. Tables of fixed shape
    (one capacity: nothing to pad) always take the batched merge."""
    return device.type == "cuda"


@functools.cache  # never evicted: a captured step reads these by address (tree/constants.py)
def _window_weights(radix: int, order: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The digit weights of `_pack` over a whole window of `order` tokens: [2 * order, order], row m
    the n-gram key of context length m (its last m + 1 tokens, radix^(order-1-j) at position j),
    row order + m its context key (the m tokens before the last, radix^(order-2-j)), 0 elsewhere;
    and [2 * order] the namespace's weights, radix^(m+1) and radix^m. int64, wrapped as _pack wraps."""
    rows = [[_wrap(radix ** (order - 1 - j)) if j >= order - 1 - m else 0 for j in range(order)]
            for m in range(order)]
    rows += [[_wrap(radix ** (order - 2 - j)) if order - 1 - m <= j <= order - 2 else 0 for j in range(order)]
             for m in range(order)]
    namespace = [_wrap(radix ** (m + 1)) for m in range(order)] + [_wrap(radix**m) for m in range(order)]
    return (device_ints(tuple(v for row in rows for v in row), device).view(2 * order, order),
            device_ints(tuple(namespace), device))


@functools.cache  # never evicted: a captured step reads these by address (tree/constants.py)
def _backoff_factors(backoff: float, order: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """[order, 1, 1, 1] each context length m (int64) and backoff^(order-1-m) (float32, as a float32
    tensor times the Python float rounds it), shaped against the [order, R, F, K] counts."""
    factors = torch.empty(order, dtype=torch.float32, device=device)
    for m in range(order):
        factors[m : m + 1].fill_(backoff ** (order - 1 - m))
    return device_ints(tuple(range(order)), device).view(order, 1, 1, 1), factors.view(order, 1, 1, 1)


@functools.cache  # never evicted: a captured step reads these by address (tree/constants.py)
def _context_powers(radix: int, orders: int, history: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The digit weights of `_pack` for contexts of 0..orders-1 tokens taken from the end of a
    `history`-token window: [orders, history] (radix^(m-1-i) on order m's i-th context token, 0 on
    the tokens before it) and [orders] the namespace's weight radix^m; int64, wrapped as _pack wraps."""
    powers = [[0] * history for _ in range(orders)]
    for m in range(orders):
        for i in range(m):
            powers[m][history - m + i] = _wrap(radix ** (m - 1 - i))
    flat = device_ints(tuple(v for row in powers for v in row), device).view(orders, history)
    return flat, device_ints(tuple(_wrap(radix**m) for m in range(orders)), device)


def _pack(namespace: Tensor, tokens: Tensor, radix: int) -> Tensor:
    """namespace [...], tokens [..., m] -> int64 keys [...] (mixed radix, wrapping): the namespace,
    then each token + 1 as a digit, the last the lowest. The digits' weights are summed in one pass
    (int64 sums and products wrap alike in any order)."""
    m = tokens.shape[-1]
    if m == 0:
        return namespace.long()
    powers = device_ints(tuple(_wrap(radix**i) for i in range(m - 1, -1, -1)), tokens.device)
    return namespace.long() * _wrap(radix**m) + ((tokens.long() + 1) * powers).sum(dim=-1)


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
    # keep every table at one capacity, changed in place (module docstring)
    fixed_shape: bool = False
    # the tables of orders 0..k-1 stacked for one search (`_stacked`), until the next change
    _stack: tuple | None = field(default=None, repr=False, compare=False)
    # (table, order) -> its count of real keys on the way to the host (`_trim`)
    _lengths: dict = field(default_factory=dict, repr=False, compare=False)
    # fixed_shape: kind -> (keys [order, capacity], counts [order, capacity]), whose rows the lists view;
    # "all": both kinds' rows as one [2 * order, capacity] pair (`_new_buffers`)
    _buffers: dict = field(default_factory=dict, repr=False, compare=False)
    generation: int = field(default=0, compare=False)  # fixed_shape: how many times the capacity grew
    # fixed_shape: windows added in all (host), and the largest real length last reported with the
    # count of windows added when it was queued: an upper bound of the real keys without a host read
    _added: int = field(default=0, repr=False, compare=False)
    _reported: tuple = field(default=(0, 0), repr=False, compare=False)

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
        if self.fixed_shape:
            longest = max(t.numel() for t in self.ngram_keys + self.context_keys)
            self._reported = (longest, 0)  # given tables: their padding counts as real until reported
            capacity = self.FIRST_CAPACITY
            while capacity < 2 * longest:
                capacity *= 2
            self._buffers = self._new_buffers(capacity)

    #: fixed_shape: the first capacity of every table (keys; it grows by doubling)
    FIRST_CAPACITY = 1024

    @property
    def radix(self) -> int:
        return self.vocab_size + 1

    @property
    def capacity(self) -> int | None:
        """fixed_shape: every table's length (real keys, then `KEY_PAD`); None otherwise."""
        return self._buffers["ngram"][0].shape[1] if self._buffers else None

    def _new_buffers(self, capacity: int) -> dict[str, tuple[Tensor, Tensor]]:
        """fixed_shape: [2 * order, capacity] keys and counts holding every table (padded), the n-gram
        tables' rows then the context tables'; the table lists' entries become its rows. Returns
        kind -> (keys, counts) [order, capacity] for "ngram" and "context", and both as "all"."""
        kbuf = torch.full((2 * self.order, capacity), KEY_PAD, dtype=torch.int64, device=self.device)
        cbuf = torch.zeros((2 * self.order, capacity), dtype=torch.int64, device=self.device)
        for first, kind in ((0, "ngram"), (self.order, "context")):
            keys, counts = self._tables(kind)
            for m in range(self.order):
                n = keys[m].numel()  # (<= capacity: real keys first, and `_make_room` keeps them within it)
                kbuf[first + m, :n], cbuf[first + m, :n] = keys[m], counts[m]
                keys[m], counts[m] = kbuf[first + m], cbuf[first + m]
        return {"ngram": (kbuf[: self.order], cbuf[: self.order]),
                "context": (kbuf[self.order :], cbuf[self.order :]), "all": (kbuf, cbuf)}

    def _make_room(self, new: int) -> None:
        """fixed_shape: grow every table's capacity (a new generation) if `new` more keys could pass it."""
        longest, added_then = self._reported
        bound = longest + (self._added - added_then) + new
        if bound <= self.capacity:
            return
        capacity = self.capacity
        while capacity < 2 * bound:
            capacity *= 2
        self._buffers = self._new_buffers(capacity)
        self._stack = None
        self.generation += 1

    def _store(self, kind: str, m: int, keys: Tensor, counts: Tensor) -> None:
        """A table's new contents: in its fixed-shape row, in place (its real keys come first, and
        `_make_room` kept them within the row), or as they are."""
        tables = self._tables(kind)
        if self.fixed_shape:
            n = tables[0][m].numel()
            tables[0][m].copy_(keys[:n])
            tables[1][m].copy_(counts[:n])
        else:
            tables[0][m], tables[1][m] = keys, counts

    def add(self, namespace: Tensor, windows: Tensor, valid: Tensor | None = None) -> None:
        """Count n-grams. windows [N, n]: n-1 context tokens (PAD where none) then the token; valid [N]
        (default all): the rows that are windows (the others count nothing, e.g. past a request's
        last token).

        No host synchronisation: a merge sorts the table with the new keys (`_merge`; on a GPU all
        tables at once, `_add_orders_at_once`), so this can run on every engine step.
        """
        if windows.dim() != 2 or windows.shape[1] != self.order:
            raise ValueError(f"windows must be [N, order={self.order}], got {tuple(windows.shape)}")
        self._trim()
        windows = to_device(windows, self.device).long()
        if self.fixed_shape:
            self._make_room(windows.shape[0])
            self._added += windows.shape[0]
        namespace = to_device(namespace, self.device).long().expand(windows.shape[0])
        ok = torch.ones_like(namespace, dtype=torch.bool) if valid is None else to_device(valid, self.device)
        if self.fixed_shape or _merge_orders_at_once(self.device):
            self._add_orders_at_once(namespace, windows, ok)
            return
        changed = []
        for m in range(self.order):  # m = context length
            ctx = windows[:, self.order - 1 - m : self.order - 1]
            # A context that reaches before the sequence start is not a real m-token context.
            real = ok & (ctx >= 0).all(dim=1) if m > 0 else ok
            ng = torch.where(real, _pack(namespace, windows[:, self.order - 1 - m :], self.radix), KEY_PAD)
            self._store("ngram", m, *_merge(self.ngram_keys[m], self.ngram_counts[m], ng, real))
            changed.append(("ngram", m))
            cx = torch.where(real, _pack(namespace, ctx, self.radix), KEY_PAD)
            self._store("context", m, *_merge(self.context_keys[m], self.context_counts[m], cx, real))
            changed.append(("context", m))
        self._changed(changed)

    def _add_orders_at_once(self, namespace: Tensor, windows: Tensor, ok: Tensor) -> None:
        """`add` of windows [N, n] (namespace [N], ok [N]) with every table merged in one batched merge:
        the same tables, key for key and count for count, as the merges table by table."""
        n = self.order
        weights, ns_weights = _window_weights(self.radix, n, self.device)
        # [2n, N] every table's key of each window (the same mixed-radix sums as _pack, wrapping alike)
        keys = ((windows[None] + 1) * weights[:, None, :]).sum(dim=2) + namespace[None] * ns_weights[:, None]
        # context length m is real where none of the m tokens before the last is PAD: [N, n-1] for m = 1..n-1
        ctx_real = windows[:, : n - 1].flip(1).cummin(dim=1).values >= 0
        real = torch.cat([ok[:, None], ctx_real & ok[:, None]], dim=1).T  # [n, N], m = 0..n-1
        new_keys = torch.where(real[None], keys.view(2, n, -1), KEY_PAD).reshape(2 * n, -1)
        new_counts = real[None].expand(2, n, real.shape[1]).reshape(2 * n, -1).long()
        tables = [("ngram", m) for m in range(n)] + [("context", m) for m in range(n)]
        if self.fixed_shape:  # one capacity: merged in place, its real keys first (`_make_room`)
            kbuf, cbuf = self._buffers["all"]
            merged, counts = _merge_rows(kbuf, cbuf, new_keys, new_counts)
            kbuf.copy_(merged[:, : kbuf.shape[1]])
            cbuf.copy_(counts[:, : cbuf.shape[1]])
            self._changed(tables, stacked=kbuf)
            return
        old_keys = [self._tables(kind)[0][m] for kind, m in tables]
        old_counts = [self._tables(kind)[1][m] for kind, m in tables]
        width = max(t.numel() for t in old_keys)  # padded by cat: the same ops whatever the sizes
        merged, counts = _merge_rows(
            torch.stack([torch.cat([t, t.new_full((width - t.numel(),), KEY_PAD)]) for t in old_keys]),
            torch.stack([torch.cat([c, c.new_zeros(width - c.numel())]) for c in old_counts]), new_keys, new_counts)
        for row, (kind, m) in enumerate(tables):
            self._tables(kind)[0][m], self._tables(kind)[1][m] = merged[row], counts[row]
        self._changed(tables, stacked=merged)

    def _tables(self, kind: str) -> tuple[list[Tensor], list[Tensor]]:
        return (self.ngram_keys, self.ngram_counts) if kind == "ngram" else (self.context_keys, self.context_counts)

    def _changed(self, tables: list[tuple[str, int]], stacked: Tensor | None = None) -> None:
        """After a change of `tables` ((kind, order) pairs): drop what was derived from the tables, and
        queue each one's count of real keys (the first `KEY_PAD`) for the host. `stacked`: the tables'
        keys as the rows of one tensor, in that order (one search for all). (fixed_shape: the
        stacked tables are the buffers themselves, changed in place.)"""
        if not self.fixed_shape:
            self._stack = None
        if not tables:
            return
        if stacked is not None:
            rows = stacked.shape[0]
            lengths = torch.searchsorted(stacked, device_ints((KEY_PAD,) * rows, self.device).view(rows, 1)).view(-1)
        else:
            pad = device_ints((KEY_PAD,), self.device)
            found = [torch.searchsorted(self._tables(kind)[0][m], pad) for kind, m in tables]
            lengths = found[0] if len(found) == 1 else torch.cat(found)
        self._lengths = {"tables": tables, "lengths": to_host_later(lengths), "added": self._added}

    def _trim(self) -> None:
        """Cut the `KEY_PAD` padding off the tables whose real length the device has reported since
        their last change (the copy queued by `_changed`; not waited for: the padding stays until
        then). Keeps a table from growing by every merge's padding."""
        pending: HostLater | None = self._lengths.get("lengths")
        lengths = pending.get() if pending is not None else None
        if lengths is None:
            return
        if self.fixed_shape:  # kept at their capacity: the report only tightens the bound of `_make_room`
            self._reported = (max(lengths.tolist()), self._lengths["added"])
            self._lengths = {}
            return
        for (kind, m), n in zip(self._lengths["tables"], lengths.tolist()):
            keys, counts = self._tables(kind)
            if n < keys[m].numel():
                keys[m], counts[m] = keys[m][:n], counts[m][:n]
        self._lengths = {}

    def real_entries(self, kind: str, m: int) -> tuple[Tensor, Tensor]:
        """One table's keys and counts without its padding (a host read: for tests and `save`)."""
        keys, counts = self._tables(kind)
        n = int((keys[m] != KEY_PAD).sum())
        return keys[m][:n], counts[m][:n]

    def drop_namespace(self, namespace: int) -> None:
        """Forget every count of one namespace (a finished request's slot); ``ValueError`` where its keys
        wrap (`drop_namespaces`)."""
        self.drop_namespaces([namespace])

    def drop_namespaces(self, namespaces: Sequence[int]) -> None:
        """Forget every count of these namespaces, in one pass over each table (no host read: their
        keys become `KEY_PAD` and the table is sorted again)."""
        if namespaces and (max(namespaces) + 1) * self.radix**self.order >= 1 << 63:
            raise ValueError(
                f"n-gram keys of order {self.order} over {self.vocab_size} tokens wrap past 63 bits for namespace "
                f"{max(namespaces)}: its counts cannot be told from another's; use a lower order")
        self._trim()
        drop = to_device(torch.tensor(sorted(set(namespaces)), dtype=torch.int64), self.device)
        changed = []
        for m in range(self.order):
            for kind, span in (("ngram", self.radix ** (m + 1)), ("context", self.radix**m)):
                keys, counts = self._tables(kind)
                self._store(kind, m, *_drop(keys[m], counts[m], drop, span))
                changed.append((kind, m))
        self._changed(changed)

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
        if self.fixed_shape:  # one capacity: the buffers' first rows, changed in place
            return (self._buffers["ngram"][0][:orders], self._buffers["ngram"][1][:orders],
                    self._buffers["context"][0][:orders], self._buffers["context"][1][:orders])
        if self._stack is None or self._stack[0] != orders:
            last = torch.iinfo(torch.int64).max

            def stack(tables: list[Tensor], counts: list[Tensor]) -> tuple[Tensor, Tensor]:
                width = max(t.numel() for t in tables)  # padded by cat: the same ops whatever the sizes
                return (torch.stack([torch.cat([t, t.new_full((width - t.numel(),), last)]) for t in tables]),
                        torch.stack([torch.cat([c, c.new_zeros(width - c.numel())]) for c in counts]))

            self._stack = (orders, *stack(self.ngram_keys[:orders], self.ngram_counts[:orders]),
                           *stack(self.context_keys[:orders], self.context_counts[:orders]))
        return self._stack[1:]

    def save(self, path: str | Path) -> None:
        """Write the tables as safetensors (metadata: order, vocab_size)."""
        from safetensors.torch import save_file

        tensors = {}
        for m in range(self.order):
            for kind in ("ngram", "context"):
                keys, counts = self.real_entries(kind, m)
                tensors[f"{kind}_keys.{m}"], tensors[f"{kind}_counts.{m}"] = keys.cpu(), counts.cpu()
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


def _merge(keys: Tensor, counts: Tensor, new_keys: Tensor, new_valid: Tensor) -> tuple[Tensor, Tensor]:
    """A sorted table keys/counts [L] with one count of each valid key of new_keys [N] (the others
    count nothing): [L + N], every key once, sorted, `KEY_PAD` (count 0) after the last. A sort and a
    segment sum, fixed shapes: no host synchronisation (`torch.unique` has one)."""
    if new_keys.numel() == 0:
        return keys, counts
    all_keys, order = torch.sort(torch.cat([keys, new_keys]))
    all_counts = torch.cat([counts, new_valid.to(counts.dtype)])[order]
    # [L + N] each key's rank among the distinct keys: how many times the key changed before it
    group = torch.cat([device_ints((0,), keys.device), all_keys[1:] != all_keys[:-1]]).cumsum(0)
    merged = torch.full_like(all_keys, KEY_PAD).scatter_(0, group, all_keys)
    return merged, torch.zeros_like(all_counts).scatter_add_(0, group, all_counts)


def _merge_rows(keys: Tensor, counts: Tensor, new_keys: Tensor, new_counts: Tensor) -> tuple[Tensor, Tensor]:
    """`_merge` of T tables at once: sorted rows keys/counts [T, L] with new_keys/new_counts [T, N]
    (count 0 for a key that counts nothing) -> [T, L + N], each row's keys once, sorted, `KEY_PAD`
    (count 0) after its last."""
    all_keys, order = torch.sort(torch.cat([keys, new_keys], dim=1), dim=1)
    all_counts = torch.cat([counts, new_counts], dim=1).gather(1, order)
    # [T, L + N] each key's rank among its row's distinct keys: how many times the key changed before it
    changes = all_keys[:, 1:] != all_keys[:, :-1]
    group = torch.cat([torch.zeros_like(changes[:, :1]), changes], dim=1).cumsum(dim=1)
    merged = torch.full_like(all_keys, KEY_PAD).scatter_(1, group, all_keys)
    return merged, torch.zeros_like(all_counts).scatter_add_(1, group, all_counts)


def _drop(keys: Tensor, counts: Tensor, namespaces: Tensor, span: int) -> tuple[Tensor, Tensor]:
    """keys/counts [L] with the keys of `namespaces` (sorted [D]) made `KEY_PAD` (count 0), sorted again."""
    if keys.numel() == 0 or namespaces.numel() == 0:
        return keys, counts
    ns = torch.div(keys, span, rounding_mode="floor")
    at = torch.searchsorted(namespaces, ns).clamp_(max=namespaces.numel() - 1)
    hit = namespaces[at] == ns
    keys, order = torch.sort(torch.where(hit, KEY_PAD, keys))
    return keys, torch.where(hit, 0, counts)[order]


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


@dataclass
class HostTokens:
    """Tokens the host holds that the tables have not counted yet (a prompt, a prefill chunk, the
    tokens of undrafted steps): row i's token_ids[i, start[i]:end[i]], counted with the up to n-1
    tokens before start[i] as their history. Host tensors: token_ids [R, T] (any integer dtype; a
    view of the engine's own token buffer), start/end [R]; a row with start >= end holds none."""

    token_ids: Tensor
    start: Tensor
    end: Tensor

    @classmethod
    def from_lists(cls, host: Sequence[tuple[Sequence[int], Sequence[int]] | None]) -> "HostTokens":
        """host[i]: None, or (context, new) lists of row i: `new` to count after `context`."""
        rows = [([], []) if h is None else (list(h[0]), list(h[1])) for h in host]
        width = max((len(c) + len(n) for c, n in rows), default=0)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, (context, new) in enumerate(rows):
            ids[i, : len(context) + len(new)] = torch.tensor(context + new, dtype=torch.int64)
        start = torch.tensor([len(c) for c, _ in rows], dtype=torch.int64)
        return cls(ids, start, start + torch.tensor([len(n) for _, n in rows], dtype=torch.int64))


def host_windows(order: int, slots: Sequence[int], host: HostTokens) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The host part of `NGramModel.observe_step`, as host tensors: the windows [N, n] of every row's
    host tokens and their namespaces [N]; the rows that have host tokens [H] and their tails after
    them [H, n-1] (PAD where a row's text is shorter). Tensor ops over all rows at once: no Python
    per row, whatever the batch."""
    n1 = order - 1
    start, end = host.start.long(), host.end.long()
    rows, row_of, position = host_positions(start, end)
    window = torch.arange(-n1, 1)  # [n]: the n-1 tokens before a token, and itself
    wins = _text_at(host.token_ids, row_of[:, None], position[:, None] + window)
    names = torch.tensor(list(slots), dtype=torch.int64)[row_of]
    tails = _text_at(host.token_ids, rows[:, None], end[rows][:, None] + window[:-1])
    return wins, names, rows, tails


def host_positions(start: Tensor, end: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Host text ranges start[i]:end[i] of R rows, flattened by tensor ops (no Python per row): the rows
    with any [H], and each of the N positions' row [N] and text position [N]."""
    count = (end - start).clamp(min=0)  # [R] positions per row
    row_of = torch.repeat_interleave(torch.arange(count.numel()), count)  # [N] each position's row
    first = torch.cumsum(count, 0) - count  # [R] where each row's positions start among the N
    return count.nonzero().flatten(), row_of, start[row_of] + torch.arange(row_of.numel()) - first[row_of]


def _text_at(token_ids: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """token_ids[rows, cols] as int64, PAD where cols < 0 (before the text)."""
    return torch.where(cols >= 0, token_ids[rows, cols.clamp(min=0)].long(), PAD)


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
        fixed_shape: bool = False,
    ) -> None:
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
        self.online = NGramCounts(order, vocab_size, self.device, fixed_shape=fixed_shape)
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
        # [slots, n-1] each slot's last committed tokens (PAD-filled on the left), on the device: a
        # step's windows start from them without a host read. Grows with the largest slot seen;
        # changed in place otherwise (a captured step reads it).
        self.tails = torch.full((0, order - 1), PAD, dtype=torch.int64, device=self.device)

    @property
    def generation(self) -> tuple[int, int]:
        """Changes whenever a table or the tails are made anew (their addresses or shapes): what keys a
        captured step that scores with this model (fixed_shape tables)."""
        return self.online.generation, self.tails.shape[0]

    def observe(self, slot: int, tokens: Sequence[int] | Tensor) -> None:
        """Count the n-grams that `tokens` (appended to the slot's sequence so far) complete."""
        self.observe_batch([slot], [tokens])

    def observe_batch(self, slots: Sequence[int], tokens: Sequence[Sequence[int] | Tensor]) -> None:
        """`observe` for many requests at once: tokens[i] (host) is appended to slots[i]'s sequence.

        One merge of the count tables for the whole batch (`observe_step` with host tokens padded
        into one [R, T] block).
        """
        if len(slots) != len(tokens):
            raise ValueError(f"observe_batch needs one token list per slot, got {len(slots)} slots and {len(tokens)} lists")
        rows = [torch.as_tensor(t, dtype=torch.int64).flatten() for t in tokens]
        block = torch.full((len(rows), max((t.numel() for t in rows), default=0)), PAD, dtype=torch.int64)
        for i, t in enumerate(rows):
            block[i, : t.numel()] = t
        self.observe_step(slots, to_device(block, self.device))

    def observe_step(self, slots: Sequence[int], tokens: Tensor, host: HostTokens | None = None) -> Tensor:
        """One engine step's new tokens, counted in one merge of the tables, with no host read.

        slots [R] host ints, each once. tokens [R, K] on any device: each row's new tokens, PAD after
        its last (vLLM's sampled tokens: the accepted path and the bonus token, -1 padded), appended
        after the slot's tail (`tails`, on the device). `host` (optional): tokens the host holds
        for some rows (a prompt, a prefill chunk), counted before tokens[i] with their host history,
        so such a row's tail comes from the host, not the device. Returns the slots as a device tensor [R].
        """
        if len(set(slots)) != len(slots):
            raise ValueError(f"observe_step got a slot twice in one call: {list(slots)}")
        if tokens.dim() != 2 or tokens.shape[0] != len(slots):
            raise ValueError(f"tokens must be [requests={len(slots)}, K], got {tuple(tokens.shape)}")
        n1 = self.order - 1
        self._grow_tails(max(slots, default=-1) + 1)
        slots_d = to_device(torch.tensor(list(slots), dtype=torch.int64), self.device)
        tail = self.tails[slots_d]  # [R, n-1]
        wins, names, rows, tails = (host_windows(self.order, slots, host) if host is not None
                                    else (None, None, torch.zeros(0, dtype=torch.int64), None))
        if rows.numel():
            tail = tail.index_put((to_device(rows, self.device),), to_device(tails, self.device))
        tokens = tokens.to(self.device).long()
        r, k = tokens.shape
        seq = torch.cat([tail, tokens], dim=1)  # [R, n-1 + K]
        valid = tokens >= 0  # [R, K]: a prefix of each row
        # [R * K, n]: the window ending at each token
        # (contiguous first: one copy at every batch size, where reshape copies only past one row)
        windows = (seq.unfold(1, self.order, 1).contiguous().view(-1, self.order) if tokens.shape[1]
                   else seq[:0, :0].view(0, self.order))
        namespace, flat_valid = slots_d.view(r, 1).expand(r, k).contiguous().view(-1), valid.view(-1)
        if wins is not None and wins.shape[0]:
            windows = torch.cat([to_device(wins, self.device), windows])
            namespace = torch.cat([to_device(names, self.device), namespace])
            flat_valid = torch.cat([torch.ones(wins.shape[0], dtype=torch.bool, device=self.device), flat_valid])
        if windows.shape[0]:
            self.online.add(namespace, windows, valid=flat_valid)
        # the new tails: the n-1 tokens before each row's first PAD
        last = valid.sum(dim=1, keepdim=True) + device_ints(tuple(range(n1)), self.device)
        self.tails.index_put_((slots_d,), seq.gather(1, last))
        return slots_d

    def _grow_tails(self, slots: int) -> None:
        if slots > self.tails.shape[0]:
            more = torch.full((max(slots, 2 * self.tails.shape[0]) - self.tails.shape[0], self.order - 1), PAD,
                              dtype=torch.int64, device=self.device)
            self.tails = torch.cat([self.tails, more])

    def release(self, slot: int) -> None:
        """Forget a finished request's counts so its slot can be reused."""
        self.release_batch([slot])

    def release_batch(self, slots: Sequence[int]) -> None:
        """`release` for many finished requests: one filter pass over the tables."""
        if not slots:
            return
        self.online.drop_namespaces(list(slots))
        self._grow_tails(max(slots) + 1)
        self.tails.index_put_((to_device(torch.tensor(list(slots), dtype=torch.int64), self.device),),
                              torch.full((), PAD, dtype=torch.int64, device=self.device))

    def context_tail(self, slots: Sequence[int] | Tensor) -> Tensor:
        """[R, n-1] last committed tokens per slot (PAD-filled on the left), for `build_tree`; a
        device gather (slots as a device tensor, or host ints)."""
        if not isinstance(slots, Tensor):
            self._grow_tails(max(slots, default=-1) + 1)
            slots = to_device(torch.tensor(list(slots), dtype=torch.int64), self.device)
        return self.tails[slots.to(self.device)]

    def log_rho(self, slots: Tensor, history: Tensor, tokens: Tensor) -> Tensor:
        """log rho(t | history) [R, F, K] for the requests in `slots` [R]; no host synchronisation."""
        rho = (1.0 - self.corpus_weight) * self._backoff(self.online, slots, history, tokens)
        if self.corpus is not None:
            zero = torch.zeros_like(slots)
            rho = rho + self.corpus_weight * self._backoff(self.corpus, zero, history, tokens)
        return torch.log(rho.clamp(min=self.floor))

    def _backoff(self, counts: NGramCounts, slots: Tensor, history: Tensor, tokens: Tensor) -> Tensor:
        # The longest context with count(c, t) > 0 decides; each step down costs a factor `backoff`.
        # Order by order (CPU): shortest context first, so a longer context's hit overwrites; all orders at
        # once (GPU): the same products, the longest hit picked in one gather (few ops: this runs per depth).
        if not _search_orders_at_once(tokens.device):
            rho = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
            for m in range(self.order):
                ng, cx = counts.lookup(slots, history, tokens, m)
                ratio = ng.float() / cx.clamp(min=1).float()[:, :, None]
                rho = torch.where(ng > 0, ratio * self.backoff ** (self.order - 1 - m), rho)
            return rho
        ng, cx = counts.lookup_orders(slots, history, tokens, self.order)  # [order, R, F, K], [order, R, F]
        lengths, factors = _backoff_factors(self.backoff, self.order, ng.device)
        # each order's backed-off ratio (0 where count(c_m, t) = 0), and the longest context with a count:
        # the largest m with one (none: 0, whose ratio is 0 there; a max, which unlike an argmax over the
        # leading dimension is fast on a CPU too)
        scored = ng.float() / cx.clamp(min=1).float()[..., None] * factors
        longest = ((ng > 0) * lengths).amax(dim=0, keepdim=True)
        return scored.gather(0, longest)[0]

    def scorer(self, slots: Sequence[int] | Tensor) -> "NGramScorer":
        """The `PrefixScorer` for a build over the requests in `slots` (row r = slots[r])."""
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

