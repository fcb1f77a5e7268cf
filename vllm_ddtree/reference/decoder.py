"""A small batch-1 speculative decoder on transformers: the correctness oracle and acceptance lab.

Methods (one loop, the tree decides which):
- "ar":      the target alone, one token per forward.
- "dflash":  DFlash's chain: the drafter's top-1 token at every depth (a tree with one candidate
             per depth), verified in one forward.
- "ddtree":  the best tree of `budget` nodes from the drafter's per-depth marginals (DDTree),
             optionally rescored with the online n-gram model (PRESTO) and with the budget picked
             per step by the cost model (BASTION) — the same `AutoBudget` the vLLM proposer uses,
             calibrated online to this decoder's measured step times and acceptances.

One speculative step, as data flows (docs/design.md §2):
    drafter([root, MASK x L] | context features)  -> logits [L, V_draft]
    topk_per_depth -> build_tree -> compile_tree   (vllm_ddtree.tree)
    target(verify rows, positions = ctx + depth, ancestor mask over the KV cache) -> logits, hidden
    walk_tree(greedy or sampled row tokens)        -> accepted path + bonus
    compaction_plan / apply_compaction_ on every KV layer, crop the rest
    drafter context += hidden states of the accepted path (root + accepted nodes)

Everything is float32-exact against "ar" for greedy decoding; sampling keeps the target's
distribution (every emitted token is one draw from the target given its ancestors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_ddtree.drafter import DFlashDrafter, DrafterKVCache, make_block
from vllm_ddtree.tree.lookup import LOOKUP_WINDOW
from vllm_ddtree.tree import (
    AutoBudget,
    CostModel,
    LookupCalibration,
    ModelShape,
    NGramModel,
    TokenHistory,
    SpeculationGate,
    add_branch,
    apply_compaction_,
    build_tree,
    compaction_plan,
    compile_tree,
    dense_attention_mask,
    get_profile,
    greedy_tokens,
    sample_tokens,
    topk_per_depth,
    walk_tree,
)

METHODS = ("ar", "dflash", "ddtree")


@dataclass
class SpecConfig:
    """How to speculate. `budget` is the fixed tree size (ddtree) or the cap when `adaptive`.

    adaptive: the tree size is chosen per step in [min_budget, budget] by the decoder's `AutoBudget`,
    which keeps its calibration across `generate` calls (like a server: the first few steps after
    the decoder is created explore sizes to fit the cost model). min_budget 0 (adaptive only) also
    lets it choose no tree: a `SpeculationGate` skips drafting while trees are not worth their cost.
    """

    method: str = "ddtree"
    budget: int = 32
    adaptive: bool = False
    min_budget: int = 1
    ngram_weight: float = 0.0
    ngram_order: int = 3
    topk: int | None = None  # candidates per depth (default: the budget)
    prompt_lookup_tokens: int = 0  # a prompt-lookup path added to each tree (ddtree only; see DDTreeConfig)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.budget < 1 or self.min_budget < (0 if self.adaptive else 1) or self.min_budget > self.budget:
            raise ValueError(f"need 1 <= min_budget <= budget (0 <= min_budget with adaptive), got "
                             f"min_budget={self.min_budget}, budget={self.budget}, adaptive={self.adaptive}")
        if self.ngram_weight < 0:
            raise ValueError(f"ngram_weight must be >= 0, got {self.ngram_weight}")
        if self.adaptive and self.method != "ddtree":
            raise ValueError(f"adaptive budget needs method 'ddtree', got {self.method!r}")
        if self.prompt_lookup_tokens < 0 or (self.prompt_lookup_tokens and self.method != "ddtree"):
            raise ValueError(f"prompt_lookup_tokens needs method 'ddtree' and >= 0, got {self.prompt_lookup_tokens} "
                             f"with {self.method!r}")


@dataclass
class SamplingConfig:
    """Target sampling: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"invalid sampling parameters {self}")


@dataclass
class GenerationResult:
    """Generated tokens and per-step statistics of one request."""

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per target forward
    budgets: list[int] = field(default_factory=list)  # draft nodes verified per step
    depths: list[int] = field(default_factory=list)  # deepest node of each step's tree
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step after prefill
    seconds: float = 0.0  # wall time of generate(), prefill included
    cache: object = None  # the target's KV cache at the end (only with keep_cache=True)
    drafter_cache: object = None  # the drafter's context K/V at its last drafting step (likewise)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward after prefill, bonus included."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def process_logits(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Target logits [..., V] -> probabilities after temperature, top-k and top-p (vLLM's order)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if sampling.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > sampling.top_p  # keep the token that crosses p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), -float("inf"))
    return torch.softmax(logits, dim=-1)


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (negative crop: the non-deprecated form)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class ReferenceDecoder:
    """Batch-1 decoder over a transformers causal LM (float32 for exactness) and a DFlash drafter."""

    def __init__(self, target, drafter: DFlashDrafter | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.target = target.eval()
        self.drafter = drafter.eval() if drafter is not None else None
        self.eos = set(eos_token_ids)
        # (min_budget, budget, ngram_weight, lookup) -> its calibrated controller: n-gram rescoring
        # changes how far the drafter's prefix probabilities can be trusted, so each scoring learns its own.
        self.auto: dict[tuple[int, int, float, int], AutoBudget] = {}
        if drafter is not None:
            self.layer_ids = list(drafter.cfg.target_layer_ids)
            self.depth = drafter.cfg.block_size - 1
            self.draft_to_target = drafter.draft_to_target

    # ---- target ---------------------------------------------------------------------------
    def _target_forward(self, ids: Tensor, positions: Tensor, cache, mask: Tensor | None):
        """ids/positions [1, n]; mask bool [1, n, kv] or None (causal). Returns logits, features."""
        attn = None
        if mask is not None:  # custom 4D additive mask, used as-is by transformers
            attn = torch.zeros(mask.shape, dtype=self.target.dtype).masked_fill(~mask, torch.finfo(self.target.dtype).min)
            attn = attn[:, None]
        out = self.target(
            input_ids=ids,
            position_ids=positions,
            attention_mask=attn,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=self.drafter is not None,
        )
        feats = None
        if self.drafter is not None:
            feats = torch.stack([out.hidden_states[i + 1] for i in self.layer_ids], dim=2)  # [1, n, F, H]
        return out.logits[0].float(), feats, out.past_key_values

    def _pick(self, logits: Tensor, sampling: SamplingConfig, gen: torch.Generator) -> Tensor:
        """One target token per row of logits [n, V]."""
        if sampling.temperature == 0:
            return greedy_tokens(logits)
        return sample_tokens(process_logits(logits, sampling), generator=gen)

    def auto_budget(self, spec: SpecConfig) -> AutoBudget:
        """The adaptive budget's controller for this range and scoring, created on first use (roofline prior)."""
        key = (spec.min_budget, spec.budget, spec.ngram_weight, spec.prompt_lookup_tokens)
        if key not in self.auto:
            shape = ModelShape.from_hf_config(self.target.config, str(self.target.dtype))
            lookup = LookupCalibration(spec.prompt_lookup_tokens) if spec.prompt_lookup_tokens > 0 else None
            gate = SpeculationGate() if spec.min_budget == 0 else None  # budget 0: no tree, no drafting
            self.auto[key] = AutoBudget(CostModel(shape, get_profile("cpu")), max(spec.min_budget, 1), spec.budget,
                                        lookup=lookup, gate=gate)
        return self.auto[key]

    # ---- decoding ---------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        spec: SpecConfig | None = None,
        sampling: SamplingConfig | None = None,
        keep_cache: bool = False,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` after `prompt_ids`, stopping after an EOS token.

        keep_cache: return the target's final KV cache in `result.cache` and the drafter's in
        `result.drafter_cache` (tests check compaction and the drafter's context).
        """
        spec = spec or SpecConfig(method="ar")
        sampling = sampling or SamplingConfig()
        if spec.method != "ar" and self.drafter is None:
            raise ValueError(f"method {spec.method!r} needs a drafter")
        if max_new_tokens < 1 or not prompt_ids:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        gen = torch.Generator().manual_seed(sampling.seed)
        t0 = time.perf_counter()
        result = GenerationResult(tokens=[])

        prompt = torch.tensor([prompt_ids])
        ctx = prompt.shape[1]
        logits, feats, cache = self._target_forward(prompt, torch.arange(ctx)[None], None, None)
        root = int(self._pick(logits[-1:], sampling, gen)[0])  # the first token is never speculated
        if self._emit(result, [root], max_new_tokens):
            result.seconds = time.perf_counter() - t0
            return result

        if spec.method == "ar":
            while True:
                t_step = time.perf_counter()
                logits, _, cache = self._target_forward(torch.tensor([[root]]), torch.tensor([[ctx]]), cache, None)
                ctx += 1
                root = int(self._pick(logits, sampling, gen)[0])
                result.accept_lengths.append(1)
                result.step_seconds.append(time.perf_counter() - t_step)
                if self._emit(result, [root], max_new_tokens):
                    break
            result.seconds = time.perf_counter() - t0
            return result

        auto = self.auto_budget(spec) if spec.adaptive else None
        drafter_cache = DrafterKVCache()
        new_feats, new_pos = feats, torch.arange(ctx)[None]
        ngram = history = None
        if spec.ngram_weight > 0:
            ngram = NGramModel(self.target.config.vocab_size, spec.ngram_order)
        if spec.prompt_lookup_tokens > 0:  # as the engine's: the last n-1 tokens' latest occurrence
            history = TokenHistory(LOOKUP_WINDOW, spec.ngram_order - 1)

        def observe(tokens: list[int]) -> None:
            for model in (ngram, history):
                if model is not None:
                    model.observe(0, tokens)

        observe(prompt_ids + [root])
        undrafted_before = False  # the last step skipped drafting: this one's drafter catches up on context
        while True:
            t_step = time.perf_counter()
            if auto is not None and not auto.speculate(1):
                # The budget chose no tree: one target step, whose features join the drafter's context.
                logits, feats, cache = self._target_forward(torch.tensor([[root]]), torch.tensor([[ctx]]), cache, None)
                new_feats = torch.cat([new_feats, feats], dim=1)
                new_pos = torch.cat([new_pos, torch.tensor([[ctx]])], dim=1)
                ctx += 1
                root = int(self._pick(logits, sampling, gen)[0])
                result.budgets.append(0)
                result.depths.append(0)
                result.accept_lengths.append(1)
                done = self._emit(result, [root], max_new_tokens)
                observe([root])
                seconds = time.perf_counter() - t_step
                result.step_seconds.append(seconds)
                auto.observe_ar_step(1, seconds)
                undrafted_before = True
                if done:
                    break
                continue
            # 1. Draft: one block [root, MASK x L] against the committed context.
            block, bpos = make_block(torch.tensor([root]), torch.tensor([ctx]), self.depth + 1)
            budget = self.depth if spec.method == "dflash" else spec.budget
            if auto is not None:
                budget = auto.build_width()
            # A tree of `budget` nodes is at most `budget` deep: logits for the root + those depths only.
            draft = self.drafter(block, bpos, new_feats, new_pos, cache=drafter_cache,
                                 logit_positions=1 + min(self.depth, budget))
            top_logp, top_draft_ids = self._candidates(draft.logits[:, 1:], spec, budget)
            top_ids = self.draft_to_target[top_draft_ids]
            # 2. Tree.
            scorer = tail = None
            if spec.ngram_weight > 0:
                scorer, tail = ngram.scorer([0]), ngram.context_tail([0])
            tree = build_tree(top_logp, top_ids, budget, scorer=scorer, context_tail=tail, lam=spec.ngram_weight)
            look = valid = None
            if spec.prompt_lookup_tokens > 0:  # the request's own text, continued: one more path
                look, valid = history.continuation([0], spec.prompt_lookup_tokens)
            if auto is not None:
                # The lookup nodes compete with the tree's at their measured acceptance.
                plan = auto.choose_plan(tree.scores, torch.tensor([ctx]), valid)
                tree = tree.truncate(plan.budgets)
                auto.grow(int(plan.budgets.max()))
                if valid is not None:
                    proposed = (look, valid)  # all of it, to learn from whether or not it is verified
                    valid = valid & (torch.arange(valid.shape[1])[None, :] < plan.extra[:, None])
            if look is not None:
                tree = add_branch(tree, look, valid, tree.max_nodes + spec.prompt_lookup_tokens)
            batch = compile_tree(tree, torch.tensor([root]), torch.tensor([ctx]))
            n = int(batch.num_rows[0])
            # 3. Verify every row in one target forward.
            mask = dense_attention_mask(batch, ctx + n)[:, :n]
            logits, feats, cache = self._target_forward(batch.tokens[:, :n], batch.positions[:, :n], cache, mask)
            row_tokens = torch.full(batch.tokens.shape, -1, dtype=torch.long)
            row_tokens[0, :n] = self._pick(logits, sampling, gen)
            walk = walk_tree(batch, row_tokens)
            k = int(walk.num_emitted[0])
            path = walk.path_rows[0, :k]
            # 4. Compact: accepted rows' K/V to slots ctx..ctx+k-1, drop the rest.
            plan_kv = compaction_plan(batch, walk.path_rows)
            for layer in cache.layers:
                for kv in (layer.keys, layer.values):
                    apply_compaction_(kv[0].transpose(0, 1), plan_kv.src[0], plan_kv.dst[0])
            _crop(cache, ctx + k)
            # 5. Commit, and feed the accepted path's hidden states to the drafter next step.
            emitted = walk.output_tokens[0, :k].tolist()
            result.budgets.append(n - 1)
            result.depths.append(int(batch.depths[0, :n].max()))
            new_feats = feats[:, path]
            new_pos = (ctx + torch.arange(k))[None]
            ctx += k
            root = emitted[-1]
            before = len(result.tokens)
            done = self._emit(result, emitted, max_new_tokens)
            result.accept_lengths.append(len(result.tokens) - before)  # what was committed
            observe(emitted)
            if auto is not None and look is not None:  # the proposal against what the target chose
                auto.observe_lookup(*proposed, torch.tensor([emitted]))
            if auto is not None:  # what the controller predicted vs what happened, and what it cost
                # Only the drafter's nodes (finite score) count: a lookup path's are not its predictions.
                on_path = torch.zeros_like(tree.valid)
                on_path[0, path[1:] - 1] = True
                auto.observe_acceptance(tree.scores, tree.valid, on_path)
                if auto.gate is not None:  # what the step committed: 1 + accepted nodes
                    auto.gate.observe_tokens(torch.tensor(float(len(emitted))))
            seconds = time.perf_counter() - t_step  # the whole cycle, the controller's bookkeeping included
            result.step_seconds.append(seconds)
            if auto is not None:
                prev = ctx - k
                # The first step also drafts over the whole prompt; one after undrafted steps over their
                # tokens: the cost fit leaves it out, the gate takes it (a probe costs that).
                if len(result.accept_lengths) > 1:
                    auto.observe_step(n, n * (prev + n), prev, seconds, fit=not undrafted_before)
            undrafted_before = False
            if done:
                break
        result.seconds = time.perf_counter() - t0
        if keep_cache:
            result.cache = cache
            result.drafter_cache = drafter_cache
        return result

    def _candidates(self, draft_logits: Tensor, spec: SpecConfig, budget: int) -> tuple[Tensor, Tensor]:
        k = 1 if spec.method == "dflash" else min(spec.topk or budget, draft_logits.shape[-1])
        return topk_per_depth(draft_logits, k)

    def _emit(self, result: GenerationResult, tokens: list[int], max_new_tokens: int) -> bool:
        """Append tokens up to an EOS or the length limit; True when generation is over."""
        for t in tokens:
            result.tokens.append(t)
            if t in self.eos or len(result.tokens) >= max_new_tokens:
                return True
        return False
