"""Tree-budget rules replayed on the same decodes: exact τ per rule, no timing noise.

    python benchmarks/budget_replay.py [--prompts 10] [--max-new-tokens 64] [--temperature 1] --cost-from STUDY.json --json PATH

For each HumanEval prompt the target's output is decoded once (greedy; at --temperature > 0 one
seeded sample of the target alone, on which the replay is exact in distribution: see
`vllm_ddtree.reference.replay`), the drafter's tree at every
root position is built once (teacher-forced, `vllm_ddtree.reference.replay`), and each rule is
replayed on those trees: every fixed budget 1..width; the automatic budget as served ("auto":
`AutoBudget` on the tree's scores, calibrated confidence, running-rate objective, width capped at
twice the last choice); the same fed the drafter's log-probabilities alone ("auto-logp", the signal
before n-gram scores were used); each step maximising its own A/C ("step-ratio", the objective before
the running rate; no width cap); and an oracle that knows each step's accepted path (an upper bound
for any rule that sees only the draft). DFlash's chain (top-1 at every depth) is replayed on the
same positions, and AR and the chain keep the step times the cost study measured for them, so the
JSON also carries the acceptance study's fields (tau, tokens_per_s, speedup_vs_ar, and
accept_hist: steps per emitted length 1..16) for a run too long to decode method by method (the
full HumanEval set at 256 tokens: `--prompts 164 --max-new-tokens 256 --width 128`). Accepted
lengths are exact (at T > 0: one draw of them per prompt, the same draw for every rule);
tokens/s are modelled with a step cost c0 + c1 * nodes fitted to the fixed-budget rows of an
acceptance study run on the same machine at the same temperature (`--cost-from`), so rules are compared on identical trees and
the same cost. A measurement, not a test. Writes JSON rows and a PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter

import torch
from tqdm import tqdm

from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
from vllm_ddtree.reference import ReferenceDecoder, SamplingConfig, SpecConfig
from vllm_ddtree.reference.pair import load_pair
from vllm_ddtree.reference.replay import (
    ReplayResult,
    best_budget_in_hindsight,
    fit_step_cost,
    replay,
    teacher_forced_trees,
)
from vllm_ddtree.tree import AcceptanceCalibration, AutoBudget, CostCalibration, CostModel, ModelShape, allocate_batch, get_profile


def heldout_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` chat-templated standard-library prompts whose responses the drafter's
    training held out (the same ids and length cut as `train.datagen`). The first of them are the ones
    every training run's periodic evaluation scored to keep its best state: for a set no choice saw,
    see :func:`fresh_heldout_prompts`."""
    from vllm_ddtree.train.dflash import is_heldout
    from vllm_ddtree.train.prompts import stdlib_prompts

    out = []
    for i, p in enumerate(stdlib_prompts()):
        ids = tokenizer(chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]
        if len(ids) <= 384 and is_heldout({"prompt_id": i}):
            out.append(ids)
            if len(out) == count:
                break
    return out


# vllm_gen wrote the standard-library prompts of at most 384 tokens in chunks of 192, in id order (22
# chunks). The fine-tunes' data took stdlib chunks 0-11 at most, and every stage's periodic evaluation
# (its first 48 held-out responses) came from the first chunks. The held-out responses of chunks 13-21
# joined the base stage's held-out set only in its last two runs, whose end-of-run comparison of the
# best-scoring state with the last kept the last both times: no choice about the drafter turned on them.
GEN_CHUNK, FRESH_FROM_CHUNK = 192, 13


def _function_text(prompt: str) -> str:
    """A prompt without its import header: the function's header and docstring."""
    m = re.search(r"(?m)^[ \t]*(async def |def )", prompt)
    return prompt[m.start():] if m else prompt


def fresh_heldout_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` chat-templated held-out standard-library prompts no choice about the drafter
    saw: `train.dflash.is_heldout` prompts of generation chunks 13-21, less (a) the members of the one
    batch the older `train.datagen` generator wrote into the base stage's data (its first, by its own
    length-sorted, seeded batch order), whose held-out responses were among the first the base stage
    evaluated, and (b) prompts whose function text (header and docstring, import header aside) is also
    another standard-library prompt's or a `doctest`-source prompt's, which were trained on."""
    from vllm_ddtree.data.humaneval import load_humaneval
    from vllm_ddtree.train.datagen import _batches
    from vllm_ddtree.train.dflash import is_heldout
    from vllm_ddtree.train.prompts import _free_function_prompts, stdlib_files, stdlib_prompts

    prompts = stdlib_prompts()
    ids = [tokenizer(chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts]
    keep = [i for i in range(len(ids)) if len(ids[i]) <= 384]
    batches = _batches([len(ids[i]) for i in keep], 96)
    order = list(range(len(batches)))
    random.Random(0).shuffle(order)
    datagen_batch = {keep[k] for k in batches[order[0]]}
    names = {p["entry_point"] for p in load_humaneval()}
    texts = Counter(_function_text(p) for p in prompts)
    own = set(prompts)  # the doctest source leaves out prompts identical to a stdlib one
    doctest_texts = {_function_text(q) for f in stdlib_files() for part in _free_function_prompts(f, names)
                     for q in part if q not in own}
    out = []
    for k, i in enumerate(keep):
        text = _function_text(prompts[i])
        if (k >= FRESH_FROM_CHUNK * GEN_CHUNK and is_heldout({"prompt_id": i}) and i not in datagen_batch
                and texts[text] == 1 and text not in doctest_texts):
            out.append(ids[i])
            if len(out) == count:
                break
    return out


def cost_model_for(shape: ModelShape, c0: float, c1: float) -> CostModel:
    """A CostModel whose step time is c0 + c1 * nodes (a step verifies nodes + 1 rows)."""
    return CostModel(shape, get_profile("cpu"), slope=1e-12, per_token=c1, intercept=max(c0 - c1, 0.0))


def on_path(tree, accepted: int) -> torch.Tensor:
    """[1, W] the step's accepted nodes: the first `accepted` nodes of the true path (ranks grow with depth)."""
    mask = torch.zeros(1, tree.scores.shape[0], dtype=torch.bool)
    mask[0, tree.path_ranks[:accepted]] = True
    return mask


def run_rules(trees_per_prompt, cost: CostModel, seconds, width: int) -> dict[str, ReplayResult]:
    """Every rule over all prompts (online rules keep their state from one prompt to the next)."""
    def total(choose, observe=None):
        out = ReplayResult(0, 0, 0, 0.0)
        for trees in trees_per_prompt:
            out = out + replay(trees, choose, seconds, observe)
        return out

    res = {f"fixed-{n}": total(lambda t, n=n: n) for n in range(1, width + 1)}
    ctx = lambda t: torch.tensor([float(t.context)])  # noqa: E731

    def served(signal):
        """`AutoBudget` as served, calibrated from the start, fed `signal(tree)` as its node scores."""
        auto = AutoBudget(cost, 1, width, calibration=CostCalibration(cost, ()))

        def choose(t):
            w = auto.build_width()
            n = int(auto.choose(signal(t)[None, :w], ctx(t))[0])
            auto.grow(n)
            return n

        return choose, lambda t, n, a: auto.observe_acceptance(
            signal(t)[None], (torch.arange(width) < n)[None], on_path(t, a))

    res["auto"] = total(*served(lambda t: t.scores))
    res["auto-logp"] = total(*served(lambda t: t.draft_logp))  # the drafter's log-prob alone as the signal
    cal = AcceptanceCalibration()  # each step's own best A/C (the objective before the running rate)
    res["step-ratio"] = total(
        lambda t: int(allocate_batch(cal.rescale(t.scores[None]), ctx(t), cost, 1, width).budgets[0]),
        lambda t, n, a: cal.update(t.scores[None], (torch.arange(width) < n)[None], on_path(t, a)))

    rate = max(r.tokens_per_second for r in res.values())
    for _ in range(3):  # the oracle's own rate: a few fixed-point rounds
        oracle = total(lambda t: best_budget_in_hindsight(t, rate, seconds, width))
        rate = oracle.tokens_per_second
    res["oracle"] = oracle
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--prompt-set", choices=("humaneval", "heldout", "heldout-fresh"), default="humaneval",
                    help="heldout: standard-library prompts the drafter's training held out (train.dflash.is_heldout); "
                         "heldout-fresh: those of them no choice about the drafter saw (fresh_heldout_prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=64, help="tree width built at every position (the largest budget)")
    ap.add_argument("--ngram-weights", default="0,0.2", help="comma-separated n-gram weights, one panel each")
    ap.add_argument("--cost-from", default="benchmarks/results/acceptance_quick.json",
                    help="acceptance-study JSON whose fixed-budget rows at --temperature give the step cost")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: replay along one seeded sample of the target per prompt (exact in distribution)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [float(w) for w in args.ngram_weights.split(",")]
    study = json.load(open(args.cost_from))

    pair = load_pair(args.drafter)
    decoder = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    shape = ModelShape.from_hf_config(pair.target.config, str(pair.target.dtype))
    if args.prompt_set == "humaneval":
        prompts = [pair.tokenizer(chat_prompt(pair.tokenizer, p["prompt"]), add_special_tokens=False)["input_ids"]
                   for p in load_humaneval(args.prompts)]
    else:
        prompts = (heldout_prompts if args.prompt_set == "heldout" else fresh_heldout_prompts)(pair.tokenizer, args.prompts)
        if len(prompts) < args.prompts:
            raise SystemExit(f"--prompt-set {args.prompt_set} has {len(prompts)} prompts; pass --prompts {len(prompts)} or fewer")
    temp = args.temperature
    sampling = [SamplingConfig(temperature=temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed + i)
                for i in range(len(prompts))]  # validates the sampling arguments before any decode
    # Cost rows at this temperature (a sampled step also samples every verify row).
    study = [r for r in study if r["temperature"] == temp]
    # AR and the chain keep the step times measured for them in the cost study (tokens/s = tau / step).
    measured = {r["method"]: r["tau"] / r["tokens_per_s"] for r in study
                if r["method"] in ("ar", "dflash") and r["tokens_per_s"] > 0}
    if len(measured) < 2:
        raise SystemExit(f"{args.cost_from} needs T = {temp:g} rows for 'ar' and 'dflash' (an acceptance.py JSON "
                         f"run at that temperature); pass another --cost-from")
    outputs = [decoder.generate(ids, args.max_new_tokens, SpecConfig(method="ar"), s).tokens
               for ids, s in tqdm(list(zip(prompts, sampling)), desc="greedy decodes" if temp == 0 else
                                  f"target samples (T = {temp:g})")]
    ar_tok_s = 1.0 / measured["ar"]
    ar_steps = sum(len(o) - 1 for o in outputs)  # the prefill token is not a step's
    rows = [dict(method="ar", budget=None, ngram_weight=0.0, temperature=temp, tau=1.0, mean_nodes=0.0,
                 tokens_per_s=ar_tok_s, speedup_vs_ar=1.0, vs_best_fixed=None, step_ms=1e3 * measured["ar"],
                 accept_hist=[ar_steps])]
    print(f"\n{len(prompts)} {args.prompt_set} prompts, {args.max_new_tokens} tokens, T = {temp:g}, trees of width "
          f"{args.width}; step cost fitted to {args.cost_from}")
    for lam in weights:
        method = "ddtree+ngram" if lam > 0 else "ddtree"
        c0, c1 = fit_step_cost([r for r in study if r["method"] == method])
        seconds = lambda n, c0=c0, c1=c1: c0 + c1 * n  # noqa: E731
        trees = [teacher_forced_trees(decoder, ids, out, args.width, ngram_weight=lam)
                 for ids, out in tqdm(list(zip(prompts, outputs)), desc=f"trees (n-gram {lam:g})")]
        res = run_rules(trees, cost_model_for(shape, c0, c1), seconds, args.width)
        if lam == 0:  # DFlash's chain: top-1 at every depth, the n-gram model plays no part
            chain = ReplayResult(0, 0, 0, 0.0)
            for ts in trees:
                chain = chain + replay([t.as_chain() for t in ts], lambda t: decoder.depth, lambda n: measured["dflash"])
            res = {"dflash": chain, **res}
        best_fixed = max((r for k, r in res.items() if k.startswith("fixed-")), key=lambda r: r.tokens_per_second)
        print(f"\nn-gram weight {lam:g}: step cost {1e3 * c0:.1f} ms + {1e3 * c1:.2f} ms/node; AR {ar_tok_s:.1f} tok/s")
        print(f"{'rule':<12}{'tau':>7}{'nodes':>7}{'tok/s':>8}{'vs AR':>7}{'vs best fixed':>15}")
        for name, r in res.items():
            n = int(name.split("-")[1]) if name.startswith("fixed-") else None
            rows.append(dict(method="fixed" if n else name, budget=n, ngram_weight=lam, temperature=temp, tau=r.tau,
                             mean_nodes=r.mean_nodes, tokens_per_s=r.tokens_per_second,
                             speedup_vs_ar=r.tokens_per_second / ar_tok_s,
                             vs_best_fixed=r.tokens_per_second / best_fixed.tokens_per_second,
                             step_ms=1e3 * (measured["dflash"] if name == "dflash" else c0),
                             node_ms=None if name == "dflash" else 1e3 * c1, accept_hist=list(r.histogram[1:])))
            if n is None or n in (1, 2, 4, 8, 16, 32, 64, 128) or r is best_fixed:
                print(f"{name:<12}{r.tau:>7.2f}{r.mean_nodes:>7.1f}{r.tokens_per_second:>8.1f}"
                      f"{rows[-1]['speedup_vs_ar']:>7.2f}{rows[-1]['vs_best_fixed']:>15.3f}")
    from plotting import plot_vs_budget, save_results

    save_results(rows, args.json, args.plot, lambda png: plot_vs_budget(
        rows, "ngram_weight", weights, f"T = {temp:g}, n-gram weight {{:g}}", series=[("fixed", "o-", "fixed budget")],
        lines=[("auto", "tab:green"), ("auto-logp", "tab:olive"), ("step-ratio", "tab:purple"), ("oracle", "black"),
               ("dflash", "tab:red"), ("ar", "gray")],
        metrics=[("tau", "tau (exact, replayed)"), ("tokens_per_s", "tokens/s (modelled step cost)")], path=png))


if __name__ == "__main__":
    main()
