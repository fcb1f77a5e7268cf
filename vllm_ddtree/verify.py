"""ddtree's verify side inside vLLM's V1 model runner (vllm_patches P11–P12).

1. `prepare_tree_step` (after `_prepare_inputs`, before attention metadata is built): the scheduled
   drafts of each request (a prefix of its tree if the scheduler truncated it) are compiled into a
   `TreeBatch`; the rows' RoPE positions become context + depth (their KV slots stay sequential);
   the ancestor masks go to the tree attention through its channel.
2. `sample_tree_step` (in place of the rejection sampler): one target token per verify row —
   argmax, or one draw from the request's processed distribution — then `walk_tree`. The accepted
   rows' K/V are moved to consecutive slots (compaction), and the proposer is told an order of the
   step's tokens with each request's accepted path first: it applies it to the context (positions,
   hidden states) it is handed, so that vLLM's DFlash input preparation — which trims rejected rows
   as a suffix — feeds the drafter exactly the accepted path at consecutive positions. Output:
   [R, depth + 1] padded with -1, the rejection sampler's layout, so vLLM's bookkeeping and the
   scheduler's rollback hold unchanged.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
from torch import Tensor
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from vllm_ddtree.tree import CHAIN, TreeBatch, schedule_rows, verify_trees

from vllm_ddtree.compaction import CacheStacks, context_order
from vllm_ddtree.proposer import DDTreeProposer, logger
from vllm_ddtree.sampling import SeededDraws, draw_options, path_logprobs, sample_rows


@dataclass
class TreeStep:
    """What the verify step of one batch needs after its forward."""

    batch: TreeBatch
    order_index: Tensor  # [R, N] flat token index of each verify row (T where padding: `context_order`)
    logit_rows: Tensor  # [R, N] each verify row's row of the target's logits (0 where padding)
    row_slots: Tensor  # [R, N] physical KV slot of each verify row (token 0's where padding)
    num_tokens: int  # T, the step's scheduled tokens
    sequential_positions: Tensor | None = None  # [T] positions before the tree's context + depth rewrite
    # [R, N] prefix score of each verify row's node (automatic budget only); -inf for the root (row 0:
    # no node), where the request's drafts are not its proposed tree (a fallback chain: no score to
    # calibrate), and on padding
    node_scores: Tensor | None = None
    step_size: tuple[float, float, float] | None = None  # (rows, attention pairs, context) if the step verified trees only


#: A verify capture's first replays compared with the eager walk (`tree.verify_trees`), one host read each.
VERIFY_CHECKED_REPLAYS = 2


class UndraftedStep:
    """A step vLLM schedules with spec-decode metadata but no drafts in it (see prepare_tree_step)."""


UNDRAFTED = UndraftedStep()


def prepare_tree_step(runner, spec_decode_metadata, total_tokens: int) -> TreeStep | UndraftedStep | None:
    """Positions = context + depth for the scheduled tree rows; tree masks to the attention backend.

    Reads only the runner's host buffers (no device-to-host copy): the step's token ids
    (`input_ids.cpu`), query starts and sequence lengths (`optimistic_seq_lens_cpu`) are exact on
    the host because ddtree never runs with async scheduling (vLLM then writes every sampled token
    to the host before the next step). The compiled tree goes to the device in queued copies.
    Returns None without spec-decode metadata, UNDRAFTED for a step in which no request has drafts.
    """
    from vllm_ddtree.attention.tree_mask import TreeStepMasks, set_step_tree_masks

    # A tree step's order for the drafter's context is for the propose right after it; vLLM skips
    # that propose when a request of the batch nears the drafter's max_model_len, and a later one
    # must not apply it to another step's tokens.
    proposer: DDTreeProposer = runner.drafter
    proposer.context_order = proposer.context_positions = proposer.step_tokens = None
    if spec_decode_metadata is None:
        set_step_tree_masks(None)
        return None
    if runner.input_batch.prev_sampled_token_ids is not None:
        # Only async scheduling leaves sampled tokens on the device; config refuses it for ddtree.
        raise RuntimeError("speculative method 'ddtree' needs async scheduling off (--no-async-scheduling)")
    req_ids = list(runner.input_batch.req_ids)
    r = len(req_ids)
    drafted = spec_decode_metadata.num_draft_tokens
    width = max(drafted)
    # No request has drafts (Dynamic SD's K = 0, or the budget chose no tree): vLLM's plain sampler
    # takes the step, as without speculation (vLLM's rejection sampler fails on a step without drafts
    # under top-k, `k.max()` of an empty tensor, vllm 0.32; our tree walk would only copy each root's
    # K/V onto itself). One token each and decode only is the speculation gate's baseline.
    if width == 0:
        if proposer.undrafted and total_tokens == r:
            proposer.pending_ar_step = r
        set_step_tree_masks(None)
        return UNDRAFTED
    calibrating = proposer.auto is not None
    qsl = runner.query_start_loc.cpu[: r + 1].long()
    drafted_t = torch.tensor(drafted, dtype=torch.int64)
    root_index = qsl[1:] - 1 - drafted_t  # the root is the first of the request's last 1 + n tokens
    step_ids = runner.input_ids.cpu  # host: each request's drafts follow its root
    # On the host, as tensor ops on [R, width] (no per-request Python): is each request's scheduled
    # drafts a prefix of its proposed tree (the scheduler kept a prefix, or all of it)? Anything
    # else (drafts vLLM filled in when the drafter was skipped) is verified as a chain, which is just
    # as lossless. And the deepest scheduled node, which bounds the walk.
    cols = torch.arange(width)
    in_draft = cols[None, :] < drafted_t[:, None]  # [R, width]
    at = ((root_index + 1)[:, None] + cols).clamp(max=step_ids.shape[0] - 1)
    drafts = torch.where(in_draft, step_ids[at].long(), 0)
    proposed = proposer.proposed
    prow = torch.tensor(list(map(proposed.row_of.get, req_ids, itertools.repeat(-1, r))), dtype=torch.int64)
    b = min(proposed.nodes, width)

    def proposed_rows(x: Tensor, fill) -> Tensor:  # [R, width]: each request's proposed row, padded
        out = torch.full((r, width), fill, dtype=x.dtype)
        if b:
            out[:, :b] = x[prow.clamp(min=0), :b] if x.shape[0] else fill
        return out

    tree_dep = proposed_rows(proposed.depths, 0)
    is_prefix = ((proposed_rows(proposed.tokens, -1) == drafts) & (tree_dep > 0)) | ~in_draft
    from_tree = (prow >= 0) & (drafted_t > 0) & is_prefix.all(dim=1)
    # The walk and the ancestor masks follow the deepest scheduled node (at most the drafter's width
    # W plus a lookup path, or a chain's length), not the step's row count.
    deepest = int(torch.where(from_tree, torch.where(in_draft, tree_dep, 0).amax(dim=1), drafted_t).max())
    ctx = runner.optimistic_seq_lens_cpu[:r].long() - 1 - drafted_t
    counts = drafted_t + 1  # logits rows are request-major, 1 + drafts per request (spec_decode_metadata.logits_indices)
    # The step's size for the cost calibration, from host numbers (no device read later).
    step_size = None
    if calibrating and int(counts.sum()) == total_tokens:  # trees, and nothing else
        rows, c = counts.double(), ctx.double()
        step_size = (float(rows.sum()), float((rows * (c + rows)).sum()), float(c.sum()))
    # The rows themselves are cut on the device from the proposer's trees, to the counts the
    # scheduler kept (one copy of the request table; captured where the proposer captures).
    table = torch.stack([prow.clamp(min=0), drafted_t, torch.where(from_tree, 0, CHAIN), root_index, ctx,
                         torch.cumsum(counts, 0) - counts])  # (tree.SCHEDULE_FIELDS)
    dev = runner.positions.device
    scheduled = schedule_rows(proposed.device_block(dev), proposed.nodes, table, runner.input_ids.gpu, width + 1,
                              deepest, calibrating, getattr(proposer, "verify_graphs", None),
                              checked_replays=VERIFY_CHECKED_REPLAYS, host_read=gpu_sync_allowed)
    batch, row_index = scheduled.batch, scheduled.row_index
    sequential = runner.positions[:total_tokens].clone()  # the drafter's context positions (sample_tree_step)
    runner.positions.index_put_((scheduled.write_index,), batch.positions)  # tree rows: context + depth
    set_step_tree_masks(TreeStepMasks(has_tree=batch.num_rows > 1, num_rows=batch.num_rows,
                                      ancestors=batch.ancestors, has_tree_cpu=drafted_t > 0))
    # (a gather: the runner rewrites its slot buffer for the next step, the moves come after it)
    row_slots = runner.input_batch.block_table[0].slot_mapping.gpu[:total_tokens][row_index]
    return TreeStep(batch=batch, order_index=torch.where(batch.valid, row_index, total_tokens),
                    logit_rows=scheduled.logit_rows, row_slots=row_slots, num_tokens=total_tokens,
                    node_scores=scheduled.node_scores, sequential_positions=sequential, step_size=step_size)


def sample_tree_step(runner, step: TreeStep, logits: Tensor, spec_decode_metadata, seeds: SeededDraws | None = None):
    """The tree walk in place of the rejection sampler, then KV compaction and drafter-input order.
    seeds: where the seeded requests' generators stood (their draws are kept there, for `settle`)."""
    from vllm.v1.outputs import SamplerOutput

    from vllm_ddtree.attention.tree_mask import set_step_tree_masks

    set_step_tree_masks(None)  # the drafter's attention is built next: plain masks for it
    batch = step.batch
    rows = step.logit_rows.to(logits.device)  # (made in prepare_tree_step from the same host counts)
    md = runner.input_batch.sampling_metadata
    counts = (torch.tensor(spec_decode_metadata.num_draft_tokens) + 1).tolist()  # host counts: ragged chunks, no device read
    budgets = getattr(runner, "_ddtree_thinking", None)  # thinking_token_budget's forced tokens, at root rows
    forced = budgets.forced_rows(runner.input_batch.req_ids) if budgets is not None and budgets.budgeted else ()
    row_tokens = sample_rows(logits, rows, md, batch, counts, forced=forced, seeds=seeds,
                             **draw_options(runner.sampler))
    proposer: DDTreeProposer = runner.drafter
    # The walk, the statistics and the drafter's calibration: one device function, captured like the
    # drafting step's where the proposer captures (`tree.verify_trees`; graphs of their own, so a
    # failed or mismatched verify capture leaves the drafting step's on). Its output is
    # [R, depth + 1], the rejection sampler's layout: the walk covers the deepest node, the step's
    # widest request may have more rows than that (a bushy tree); -1 pads the rest.
    # (a padding row's token is never read: no valid row descends from it, and the walk keeps valid rows)
    auto = proposer.auto
    verified = verify_trees(batch, row_tokens, step.node_scores, None if auto is None else auto.acceptance,
                            getattr(proposer, "verify_graphs", None), checked_replays=VERIFY_CHECKED_REPLAYS,
                            host_read=gpu_sync_allowed, row_slots=step.row_slots)
    walk = verified.walk
    out = walk.output_tokens.to(torch.int32)
    path_rows = walk.path_rows

    # KV compaction in the target's caches (slot of row path[j] -> slot of row j; the device function
    # found the moves, up to the walk's width: past the deepest node they are no-ops, not applied), and
    # the order of the step's tokens with each request's accepted path first: vLLM's DFlash input prep
    # trims a rejected suffix. The proposer applies that order to the context it is handed (the
    # runner's own buffers stay as they are: they are the target's step state).
    moves, depth = verified.moves, batch.max_depth
    _compact_target_caches(runner, moves.src_slots[:, :depth], moves.dst_slots[:, :depth])
    runner.drafter.context_order = context_order(step.order_index, moves.path_first, step.num_tokens)
    # The drafter's context positions stay sequential: after the reorder the accepted path sits at
    # ctx, ctx + 1, ... (its depths), and the rejected rows after it, at positions no accepted row
    # has. With the tree's positions (ctx + depth) a rejected row would share an accepted row's
    # position, and vLLM's DFlash context store would overwrite that row's K/V with it.
    runner.drafter.context_positions = step.sequential_positions
    runner.drafter.step_tokens = out  # the n-gram model's new tokens (DDTreeProposer._observe)
    proposer.stats.record(verified.sums, batch.batch_size)
    if auto is not None:
        if step.node_scores is not None:  # the calibration was fed on the device: its host count
            auto.acceptance.updates += 1
        if step.step_size is not None:  # the step verified trees only: its cost is known
            proposer.pending_step = step.step_size
        if auto.gate is not None:  # what the step committed, for the gate's next decision
            auto.gate.observe_tokens(verified.committed)
    logprobs = None
    if md.max_num_logprobs is not None or md.logprob_token_ids:
        path_rows = rows.gather(1, path_rows.clamp(min=0).to(rows.device))
        logprobs = path_logprobs(runner.sampler, logits, path_rows, out, md.max_num_logprobs, md.logprob_token_ids)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)


@dataclass
class ProfiledTreeStep:
    """The transient work of ddtree's largest step, as run inside vLLM's memory profile."""

    verify_rows: int  # the target's logits rows of the largest verify step, sampled (top-k, top-p)
    verify_requests: int  # the requests those rows belong to (1 + verify width rows each)
    draft_rows: int  # the drafter head's rows of the largest drafting step (top-k in chunks)
    draft_top_k: int  # candidates per row there (the largest tree's)


def largest_verify_step(max_num_tokens: int, max_num_seqs: int, verify_width: int) -> tuple[int, int]:
    """(rows, requests) of the largest verify step: 1 + `verify_width` rows for each of the most
    requests, within the step's `max_num_tokens` (the scheduler's token budget). The last request
    has fewer rows where the budget ends inside its tree (the scheduler keeps a prefix of it)."""
    per_request = 1 + verify_width
    rows = min(max_num_tokens, max_num_seqs * per_request)
    return rows, -(-rows // per_request)


def profile_step_enabled(is_cpu: bool) -> bool:
    """Whether vLLM's profile run runs ddtree's largest step (`VLLM_DDTREE_PROFILE_STEP`: 1, 0, or auto,
    the default: where vLLM sizes the KV cache from that run's peak, which a CPU engine does not: its
    cache is ``VLLM_CPU_KVCACHE_SPACE``, and its profile run only warms up compilation)."""
    value = os.environ.get("VLLM_DDTREE_PROFILE_STEP", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"VLLM_DDTREE_PROFILE_STEP must be auto (the default), 0 or 1, got {value!r}")
    return value == "1" or (value == "auto" and not is_cpu)


def profile_tree_step(runner, hidden: Tensor) -> ProfiledTreeStep:
    """ddtree's largest step run on random data, inside vLLM's memory profile (vllm_patches P20).

    vLLM sizes the KV cache from the peak memory of its profile run, whose sampler sees one logits
    row per request (`_dummy_sampler_run`). A tree step's transients outgrow that: the target's
    logits over every verify row ([rows, V], up to max_num_batched_tokens rows) and the tree
    sampler's float32 chunk beside them, then the drafter head's chunked top-k. Running them here,
    at their largest, puts them in the peak, so the KV cache leaves room for them. hidden [n, H]:
    the profile's target hidden states (their width and dtype).
    """
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_ddtree.tree import DraftTree, compile_tree

    proposer: DDTreeProposer = runner.drafter
    width = proposer.max_budget  # the verify width
    rows, r = largest_verify_step(runner.max_num_tokens, runner.max_num_reqs, width)
    n, dev = 1 + width, hidden.device
    counts = [n] * (rows // n) + ([rows % n] if rows % n else [])
    logits = runner.model.compute_logits(torch.rand(rows, hidden.shape[-1], dtype=hidden.dtype, device=dev))
    # R chains of N rows, node j's parent j - 1 (the last chain's rows past its count are padding:
    # logits row 0, as a step pads)
    depths = torch.arange(1, n, device=dev).repeat(r, 1)
    scores, valid, roots = torch.zeros(r, n - 1, device=dev), depths > 0, torch.zeros(r, dtype=torch.int64, device=dev)
    chains = DraftTree(torch.zeros_like(depths), depths - 2, depths, scores, scores, valid, valid.sum(1), max(n - 1, 1))
    batch = compile_tree(chains, roots, roots)
    starts = torch.arange(r, device=dev) * n
    cols = torch.arange(n, device=dev)
    row_index = torch.where(starts[:, None] + cols < rows, starts[:, None] + cols, 0)
    full = lambda x: torch.full((r,), x, device=dev)  # noqa: E731
    # vLLM's own dummy sampling parameters (`_dummy_sampler_run`): every request sampled, top-k and top-p
    md = SamplingMetadata(temperature=full(0.5), all_greedy=False, all_random=False, top_p=full(0.9),
                          top_k=full(logits.shape[1] - 1), generators={}, max_num_logprobs=None, no_penalties=True,
                          prompt_token_ids=None, frequency_penalties=full(0.1), presence_penalties=full(0.1),
                          repetition_penalties=full(0.1), output_token_ids=[[] for _ in range(r)],
                          allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    sample_rows(logits, row_index, md, batch, counts, **draw_options(runner.sampler))
    del logits
    draft_rows, k = proposer.profile_draft_head()
    logger.info("ddtree: the memory profile ran the largest tree step: the target's logits over %d verify rows "
                "(%d requests) sampled, the drafter head's top-%d over %d rows", rows, r, k, draft_rows)
    return ProfiledTreeStep(verify_rows=rows, verify_requests=r, draft_rows=draft_rows, draft_top_k=k)


def _compact_target_caches(runner, src_slots: Tensor, dst_slots: Tensor) -> None:
    """Apply the slot moves to every target attention layer (the drafter rewrites its own context)."""
    found = getattr(runner, "_ddtree_target_caches", None)
    if found is None:  # the layer caches are allocated once; look them up on the first step
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.platforms import current_platform

        drafter_layers = getattr(runner.drafter, "_draft_attn_layer_names", set())
        layers = {name: layer for name, layer in get_layers_from_vllm_config(runner.vllm_config, Attention).items()
                  if name not in drafter_layers}
        caches = [layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache for layer in layers.values()]
        # P9 decides the backend the same way: ours on the CPU (in CPU_ATTN's layout where its probe
        # reads it back), vLLM's FlashInfer on a GPU.
        layout = "flashinfer"
        if current_platform.is_cpu():
            from vllm_ddtree.attention.cpu_tree import cache_layout

            layout = cache_layout(caches[0], next(iter(layers.values()))) if caches else "rows"
        found = runner._ddtree_target_caches = (caches, layout)
    made = getattr(runner, "_ddtree_target_stacks", None)  # (the lookup it was made from, CacheStacks)
    if made is None or made[0] is not found:  # checked and stacked once, not every step
        made = runner._ddtree_target_stacks = (found, CacheStacks.of(*found))
    made[1].move_(src_slots, dst_slots)
