"""Sampling the verify rows of a tree step, with vLLM's own sampling operations.

Each verify row is sampled as the next position after its root-to-node path: penalties and
constraints (allowed tokens, bad words, min_tokens) see the request's output plus the row's path,
exactly as vLLM's rejection sampler applies them to a chain; temperature, top-k and top-p are vLLM's
ops; the draw is an exponential race, seeded per request where the request has a seed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_ddtree.tree import TreeBatch, sample_tokens


def sample_rows(logits: Tensor, rows: Tensor, md, batch: TreeBatch) -> Tensor:
    """One target token per verify row: argmax, or one draw from the request's processed distribution.

    logits [T, V]: the step's logits rows, request-major; rows [R, N]: the logits row of each verify
    row (0 where padding); md: vLLM's SamplingMetadata. Returns [R, N] tokens (garbage where padding).
    """
    r, n = rows.shape
    penalized = not md.no_penalties
    constrained = _has_constraints(md)
    if md.all_greedy and not penalized and not constrained:
        row_tokens = logits.argmax(-1)[rows]  # argmax first: no [R, N, V] copy on the plain greedy path
    else:
        row_logits = logits[rows].float()  # [R, N, V]
        if penalized:
            row_logits = tree_penalties(row_logits, md, batch)
        if constrained:
            row_logits = tree_constraints(row_logits, md, batch)
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
            for i, gen in md.generators.items():  # per-request seeds
                if i < r:
                    noise[i].exponential_(generator=gen)
            sampled = sample_tokens(probs, noise)
            is_greedy = (md.temperature[:r] < 1e-5).view(r, 1)
            row_tokens = torch.where(is_greedy, greedy, sampled)
    return row_tokens


def tree_penalties(row_logits: Tensor, md, batch: TreeBatch) -> Tensor:
    """Presence, frequency and repetition penalties for every verify row, as vLLM applies them.

    The tokens a row's distribution is penalised for are the request's output so far (its last
    token is the tree's root) plus the draft tokens on the row's path: the row's own token and its
    ancestors'. This is vLLM's rule for a chain (rejection_sampler._combine_outputs_with_spec_tokens)
    applied to each root-to-node path, built as one padded tensor, with vLLM's own penalty op.
    row_logits [R, N, V] float32 -> penalised [R, N, V].
    """
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.utils.torch_utils import make_tensor_with_pad

    r, n, v = row_logits.shape
    dev = row_logits.device
    outputs = make_tensor_with_pad(md.output_token_ids[:r], pad=v, device="cpu", dtype=torch.int64).to(dev)
    outputs = outputs.masked_fill(outputs < 0, v)  # async-scheduling placeholders
    on_path = (batch.ancestors & batch.valid.unsqueeze(1)).to(dev)  # [R, N, N]: row i's path includes row j
    on_path[:, :, 0] = False  # the root is already the last output token
    path_tokens = torch.where(on_path, batch.tokens.to(dev).unsqueeze(1), v)  # [R, N, N], pad v
    row_outputs = torch.cat([outputs.unsqueeze(1).expand(r, n, -1), path_tokens], 2).view(r * n, -1)

    def per_row(x: Tensor) -> Tensor:
        return x[:r].repeat_interleave(n, 0)

    flat = apply_penalties(row_logits.reshape(r * n, v), per_row(md.prompt_token_ids), row_outputs,
                           per_row(md.presence_penalties), per_row(md.frequency_penalties),
                           per_row(md.repetition_penalties))
    return flat.view(r, n, v)


def _min_tokens_state(md) -> dict:
    """vLLM's min_tokens processor state: req index -> (min_tokens, output ids, stop ids, structured)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    for proc in md.logitsprocs.non_argmax_invariant:
        if isinstance(proc, MinTokensLogitsProcessor):
            return proc.min_toks
    return {}


def _has_constraints(md) -> bool:
    return md.allowed_token_ids_mask is not None or bool(md.bad_words_token_ids) or bool(_min_tokens_state(md))


def tree_constraints(row_logits: Tensor, md, batch: TreeBatch) -> Tensor:
    """allowed_token_ids, bad_words and min_tokens for every verify row, as vLLM applies them to a chain.

    Replaces the constraint part of ``RejectionSampler.apply_logits_processors`` (rejection_sampler.py:307),
    which covers exactly these three (plus penalties, see :func:`tree_penalties`); logit_bias and
    min_p are refused for every speculative method by vLLM itself. Each row is treated as the
    next position after its root-to-node path: min_tokens masks the stop tokens while
    ``len(output) + depth < min_tokens``; a bad word's last token is masked where the output so far
    plus the row's path ends with the word's other tokens. row_logits [R, N, V] -> [R, N, V].
    """
    r, n, v = row_logits.shape
    dev = row_logits.device
    if md.allowed_token_ids_mask is not None:  # True = not allowed; the same for every row of a request
        row_logits = row_logits.masked_fill(md.allowed_token_ids_mask[:r].unsqueeze(1).to(dev), float("-inf"))
    for i, (min_toks, out_ids, stop_ids, _) in _min_tokens_state(md).items():
        if i >= r or not stop_ids:
            continue
        too_short = (len(out_ids) + batch.depths[i].to(dev)) < min_toks  # [N]
        stops = torch.tensor(sorted(stop_ids), device=dev)
        row_logits[i, :, stops] = row_logits[i, :, stops].masked_fill(too_short.unsqueeze(1), float("-inf"))
    if md.bad_words_token_ids:
        from vllm.v1.sample.ops.bad_words import apply_bad_words

        # Host-side, like vLLM's own (apply_bad_words_with_drafts): only requests that set bad_words pay.
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


def path_logprobs(sampler, logits: Tensor, path_rows: Tensor, out: Tensor, num_logprobs: int):
    """Logprobs of the emitted tokens, in the rejection sampler's layout (vLLM raw modes).

    path_rows [R, D + 1]: logits row of each emitted position (the accepted path, then the bonus);
    out [R, D + 1] emitted tokens, -1 past the end (those positions are dropped by vLLM's
    parse_output, like the rejection sampler's rejected ones).
    """
    raw = logits[path_rows.reshape(-1)].float()
    if sampler.logprobs_mode == "raw_logprobs":
        raw = sampler.compute_logprobs(raw)
    tokens = out.reshape(-1).to(torch.int64).clamp(min=0)
    return sampler.gather_logprobs(raw, num_logprobs, tokens)
