"""Tree-budget policies replayed exactly on one decode: τ without timing noise.

At T = 0 the output is the target's greedy continuation whatever trees were verified, so the tree
the drafter proposes at each position can be built once, teacher-forced (drafter context = the
target's features of the true prefix, as the decoder feeds it after accepting that prefix), and
any budget rule can then be replayed on the same positions: a step rooted at position p with N
nodes accepts exactly the true path's nodes among the tree's first N (best-first order puts every
ancestor before its descendants), then emits the bonus token and moves to the next root. This
compares fixed budgets and adaptive rules on identical trees; the reference decoder itself is the
check (a fixed budget replays to its accepted lengths, tested).

At T > 0 the same replay is exact in distribution. The tree walk (`tree.verify`) draws one target
token at each row it visits and follows the child carrying it, so a decode's accepted lengths are a
function of its output alone: the longest path of the tree's first N nodes that spells the next
output tokens. A speculative decode's output has the target's distribution (lossless), so replaying
the rules along one sampled AR decode of the target gives each rule's accepted lengths with exactly
the distribution a speculative run of that rule would have (and all rules see the same sample,
which pairs their comparison). Replaying along a speculative run's own output gives back its
accepted lengths (tested).

Trees are built at one width for every rule. With n-gram rescoring a wider candidate set can
reorder a tree's first N nodes slightly against a tree built at width N; without it they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from vllm_ddtree.drafter import DrafterKVCache, make_block
from vllm_ddtree.tree import NGramModel, build_tree, topk_per_depth

from .decoder import ReferenceDecoder


@dataclass
class PositionTree:
    """The tree proposed at one root position of a greedy decode.

    draft_logp  [W] float  drafter prefix log-probabilities, best-first (-inf past the tree)
    scores      [W] float  the tree's prefix scores (= draft_logp without n-gram rescoring)
    path_ranks  [k] int64  best-first index of the true continuation's nodes, depth 1..k (k <= 15)
    remaining   int        tokens the decode still emits after this root (the cap of a step)
    context     int        context length at this root (root excluded)
    chain_accepted  int    draft tokens DFlash's chain (top-1 at every depth) accepts here
    """

    draft_logp: Tensor
    scores: Tensor
    path_ranks: Tensor
    remaining: int
    context: int
    chain_accepted: int = 0

    def accepted(self, budget: int) -> int:
        """Draft tokens a step with `budget` nodes accepts here."""
        return int((self.path_ranks < budget).sum())

    def as_chain(self) -> "PositionTree":
        """The chain's step at this root as a tree: its depth-d node is best-first node d - 1, so
        `replay(chains, lambda t: depth)` replays DFlash's chain."""
        k = self.chain_accepted
        return PositionTree(self.draft_logp, self.scores, torch.arange(k), self.remaining, self.context, k)


@dataclass
class ReplayResult:
    """One budget rule replayed over a decode (or several, summed)."""

    steps: int
    tokens: int  # emitted by the steps (bonus included; the prefill token is not a step's)
    nodes: int  # draft nodes verified, summed over steps
    seconds: float  # sum of the cost function over the steps
    histogram: tuple[int, ...] = ()  # histogram[k]: steps that emitted k tokens (k = 1 .. depth + 1)

    @property
    def tau(self) -> float:
        return self.tokens / max(self.steps, 1)

    @property
    def mean_nodes(self) -> float:
        return self.nodes / max(self.steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __add__(self, other: "ReplayResult") -> "ReplayResult":
        a, b = self.histogram, other.histogram
        size = max(len(a), len(b))
        hist = tuple((a[k] if k < len(a) else 0) + (b[k] if k < len(b) else 0) for k in range(size))
        return ReplayResult(self.steps + other.steps, self.tokens + other.tokens, self.nodes + other.nodes,
                            self.seconds + other.seconds, hist)


@torch.inference_mode()
def teacher_forced_trees(decoder: ReferenceDecoder, prompt_ids: list[int], output_ids: list[int], width: int,
                         ngram_weight: float = 0.0, ngram_order: int = 3) -> list[PositionTree]:
    """The width-`width` tree at every root position of a decode (`output_ids`: the target's output
    for `prompt_ids`, its first token included: greedy, or one sample at T > 0, see the module
    docstring); one drafter forward per position. `path_ranks` follow `output_ids`."""
    if decoder.drafter is None:
        raise ValueError("teacher_forced_trees needs a decoder with a drafter")
    if width < 1 or not prompt_ids or not output_ids:
        raise ValueError("need width >= 1, a prompt and an output")
    full = list(prompt_ids) + list(output_ids)
    n_prompt, n_full = len(prompt_ids), len(full)
    ids = torch.tensor([full])
    _, feats, _ = decoder._target_forward(ids, torch.arange(n_full)[None], None, None)  # [1, n, F, H]
    cache = DrafterKVCache()
    ngram = NGramModel(decoder.target.config.vocab_size, ngram_order) if ngram_weight > 0 else None
    if ngram is not None:
        ngram.observe(0, full[: n_prompt + 1])
    trees = []
    for p in range(n_prompt, n_full - 1):  # root at p: the drafter has seen features of 0..p-1
        new = slice(0, p) if p == n_prompt else slice(p - 1, p)
        block, bpos = make_block(torch.tensor([full[p]]), torch.tensor([p]), decoder.depth + 1)
        draft = decoder.drafter(block, bpos, feats[:, new], torch.arange(new.start, new.stop)[None], cache=cache,
                                logit_positions=1 + decoder.depth)  # every depth: the chain uses all of them
        depth_logits = draft.logits[0, 1:]  # [depth, V_draft]
        # The chain: the drafter's top-1 at every depth, accepted while it matches the true continuation.
        chain = decoder.draft_to_target[depth_logits.argmax(-1)].tolist()
        truth = full[p + 1 : p + 1 + decoder.depth]
        chain_accepted = next((d for d, (c, t) in enumerate(zip(chain, truth)) if c != t), len(truth))
        tree_logits = draft.logits[:, 1 : 1 + min(decoder.depth, width)]
        top_logp, top_ids = topk_per_depth(tree_logits, min(width, draft.logits.shape[-1]))
        scorer = tail = None
        if ngram is not None:
            scorer, tail = ngram.scorer([0]), ngram.context_tail([0])
        tree = build_tree(top_logp, decoder.draft_to_target[top_ids], width, scorer=scorer, context_tail=tail,
                          lam=ngram_weight)
        ranks, parent = [], -1
        for d in range(1, min(decoder.depth, n_full - 1 - p) + 1):
            hit = tree.valid[0] & (tree.parents[0] == parent) & (tree.tokens[0] == full[p + d])
            if not bool(hit.any()):
                break
            parent = int(hit.nonzero()[0, 0])
            ranks.append(parent)
        trees.append(PositionTree(tree.draft_logp[0], tree.scores[0], torch.tensor(ranks, dtype=torch.long),
                                  n_full - 1 - p, p, chain_accepted))
        if ngram is not None:
            ngram.observe(0, [full[p + 1]])
    return trees


def replay(trees: list[PositionTree], choose: Callable[[PositionTree], int],
           seconds: Callable[[int], float] = lambda n: 0.0,
           observe: Callable[[PositionTree, int, int], None] | None = None) -> ReplayResult:
    """Step through a decode with `choose(tree) -> budget` at each root; `seconds(budget)` is a step's
    cost, `observe(tree, budget, accepted)` sees each step's outcome (an online rule learns from it)."""
    i, res = 0, ReplayResult(0, 0, 0, 0.0)
    while i < len(trees):
        t = trees[i]
        n = choose(t)
        if n < 0:
            raise ValueError(f"a budget rule returned {n} nodes")
        a = t.accepted(n)
        emit = min(a + 1, t.remaining)
        res = res + ReplayResult(1, emit, n, seconds(n), (0,) * emit + (1,))
        if observe is not None:
            observe(t, n, a)
        i += emit
    return res


def fit_step_cost(rows: list[dict]) -> tuple[float, float]:
    """(seconds per step at 0 nodes, seconds per node) fitted to fixed-budget rows of an acceptance
    study ({"budget", "tau", "tokens_per_s"}): a step takes tau / tokens_per_s."""
    pts = [(r["budget"], r["tau"] / r["tokens_per_s"]) for r in rows if r.get("budget") and r["tokens_per_s"] > 0]
    if len(pts) < 2:
        raise ValueError("need at least two fixed-budget rows to fit a step cost")
    x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return float(y.mean() - slope * x.mean()), max(slope, 0.0)


def best_budget_in_hindsight(tree: PositionTree, rate: float, seconds: Callable[[int], float], max_budget: int) -> int:
    """The budget an oracle that knew the accepted path would pick at this root, with the same
    tokens-minus-rate-times-cost objective: an upper bound for any rule that only sees the draft."""
    best, best_n = -math.inf, 1
    for n in range(1, max_budget + 1):
        v = min(tree.accepted(n) + 1, tree.remaining) - rate * seconds(n)
        if v > best:
            best, best_n = v, n
    return best_n
