"""Where in an answer each drafter's chain is accepted: DFlash chain τ by output position (a measurement).

    python benchmarks/chain_by_position.py --drafters vllm_ddtree/checkpoints/smollm2-dflash,OTHER [--prompts 164] [--max-new-tokens 256] --json PATH

The target's greedy output for each HumanEval prompt is decoded once; for every drafter, DFlash's
chain (top-1 at every depth) is replayed along those outputs (exact at T = 0:
`vllm_ddtree.reference.replay`), and each step is counted in the window of output positions its root
falls in (`--windows`, default 0-32-64-128-256). τ per window = tokens the window's steps emitted
(bonus included) / its steps. The same split is made between looping outputs (some 8-token sequence 5
or more times: `train.dflash.max_ngram_repeats`, the test `--drop-loops 5` applies to training data)
and the rest. Writes JSON rows and a PNG (τ per window, one line per drafter).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
from vllm_ddtree.drafter import load_drafter
from vllm_ddtree.reference import ReferenceDecoder, SpecConfig
from vllm_ddtree.reference.pair import load_pair
from vllm_ddtree.reference.replay import replay, teacher_forced_trees
from vllm_ddtree.train.dflash import max_ngram_repeats


def chain_by_window(trees, n_prompt: int, depth: int, edges: list[int]) -> tuple[list[int], list[int]]:
    """(steps, tokens) per window [edges[i], edges[i+1]) of output positions, for the chain replayed on
    one decode's `trees` (roots at absolute positions n_prompt, n_prompt + 1, ...)."""
    steps, tokens = [0] * (len(edges) - 1), [0] * (len(edges) - 1)

    def observe(t, n, accepted):
        pos = t.context - n_prompt
        w = next((i for i in range(len(edges) - 1) if edges[i] <= pos < edges[i + 1]), None)
        if w is not None:
            steps[w] += 1
            tokens[w] += min(accepted + 1, t.remaining)

    replay([t.as_chain() for t in trees], lambda t: depth, observe=observe)
    return steps, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", required=True, help="comma-separated drafter directories")
    ap.add_argument("--prompts", type=int, default=164)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--windows", default="0,32,64,128,256", help="edges of the output-position windows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    edges = [int(x) for x in args.windows.split(",")]
    if len(edges) < 2 or edges != sorted(set(edges)) or edges[0] < 0:
        raise SystemExit(f"--windows must be two or more increasing non-negative edges, got {args.windows}")
    drafters = args.drafters.split(",")

    pair = load_pair(drafters[0])
    decoder = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    prompts = [pair.tokenizer(chat_prompt(pair.tokenizer, p["prompt"]), add_special_tokens=False)["input_ids"]
               for p in load_humaneval(args.prompts)]
    outputs = [decoder.generate(ids, args.max_new_tokens, SpecConfig(method="ar")).tokens
               for ids in tqdm(prompts, desc="greedy decodes")]
    looping = [max_ngram_repeats(out, 8) >= 5 for out in outputs]
    embed = pair.target.get_input_embeddings().weight.detach()

    rows = []
    for ddir in drafters:
        drafter = pair.drafter if ddir == drafters[0] else load_drafter(Path(ddir), embed, dtype=torch.float32).eval()
        dec = ReferenceDecoder(pair.target, drafter, eos_token_ids=pair.eos_token_ids)
        per_prompt = []
        for ids, out in tqdm(list(zip(prompts, outputs)), desc=f"chain {ddir}"):
            trees = teacher_forced_trees(dec, ids, out, width=1)
            per_prompt.append(chain_by_window(trees, len(ids), dec.depth, edges))
        for subset, keep in (("all", lambda i: True), ("looping", lambda i: looping[i]),
                             ("not looping", lambda i: not looping[i])):
            for w in range(len(edges) - 1):
                steps = sum(per_prompt[i][0][w] for i in range(len(prompts)) if keep(i))
                toks = sum(per_prompt[i][1][w] for i in range(len(prompts)) if keep(i))
                rows.append(dict(drafter=ddir, outputs=subset, window=[edges[w], edges[w + 1]], steps=steps,
                                 tokens=toks, tau=toks / steps if steps else None))

    print(f"\n{len(prompts)} HumanEval prompts, {args.max_new_tokens} tokens, greedy; "
          f"{sum(looping)} outputs loop (an 8-gram 5+ times)")
    head = "".join(f"{f'{a}-{b}':>11}" for a, b in zip(edges, edges[1:]))
    for subset in ("all", "looping", "not looping"):
        print(f"\nchain tau by output position, {subset} outputs\n{'drafter':<40}{head}")
        for ddir in drafters:
            cells = [r for r in rows if r["drafter"] == ddir and r["outputs"] == subset]
            print(f"{ddir[-40:]:<40}" + "".join(f"{r['tau']:>11.2f}" if r["tau"] else f"{'-':>11}" for r in cells))
    from plotting import save_results

    save_results(rows, args.json, args.plot, lambda png: plot(rows, drafters, edges, png))


def plot(rows: list[dict], drafters: list[str], edges: list[int], path: str) -> None:
    """τ per window against the window's midpoint, one panel per output subset, one line per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import save_png

    subsets = ("all", "looping", "not looping")
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharey=True)
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    for ax, subset in zip(axes, subsets):
        for ddir in drafters:
            taus = [r["tau"] for r in rows if r["drafter"] == ddir and r["outputs"] == subset]
            ax.plot(mids, taus, "o-", label=ddir)
        ax.set_xticks(mids, [f"{a}-{b}" for a, b in zip(edges, edges[1:])])
        ax.set_xlabel("output positions of the step's root")
        ax.set_title(f"{subset} outputs")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("DFlash chain tau (exact replay)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
