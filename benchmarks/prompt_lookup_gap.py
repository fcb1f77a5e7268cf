"""How much of the target's output a lookup in its own text predicts that the drafter misses (a measurement).

    python benchmarks/prompt_lookup_gap.py [--prompts 10] [--max-new-tokens 128] --json PATH

Replay on the target's greedy outputs (HumanEval chat prompts, float32): at every output position,
the drafter's block from that root (context = the target's hidden states, as in decoding) and the
prompt-lookup path of `TokenHistory.continuation` (the request's prompt and output so far). Reports:

- how often the lookup has a next token, how often it is right, and the drafter's first-token
  accuracy at those positions and elsewhere;
- stepped tau (tokens per target forward, bonus included: from the first output token, each step
  accepts the longest matching prefix, then moves past it) of the drafter's chain, the lookup path
  alone, DDTree at `--budget` (plain, best-first over the drafter's top-k per depth) and the same tree
  with the lookup path added by `tree.add_branch` (what `prompt_lookup_tokens` does in vLLM).
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm

from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
from vllm_ddtree.drafter import make_block
from vllm_ddtree.reference.pair import load_pair
from vllm_ddtree.tree import TokenHistory, add_branch, build_tree, topk_per_depth
from vllm_ddtree.tree.lookup import LOOKUP_WINDOW


def accepted_on_tree(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Longest prefix of `truth` that is a root-to-node path of the tree (greedy verification)."""
    node, depth = -1, 0
    while depth < len(truth):
        child = [i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == truth[depth]]
        if not child:
            break
        node, depth = child[0], depth + 1
    return depth


def stepped_tau(accepted: dict[int, int], start: int, end: int) -> list[int]:
    """Tokens per step when decoding from `start`: each step emits accepted[p] + 1 tokens."""
    steps, p = [], start
    while p < end:
        steps.append(accepted[p] + 1)
        p += accepted[p] + 1
    return steps


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=16, help="DDTree budget of the tree rows")
    ap.add_argument("--lookup-tokens", type=int, default=8)
    ap.add_argument("--ngram-order", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair()
    drafter, target = pair.drafter, pair.target
    layers = drafter.cfg.target_layer_ids
    methods = ("drafter chain", "lookup path", f"ddtree B={args.budget}", f"ddtree B={args.budget} + lookup")
    steps: dict[str, list[int]] = {m: [] for m in methods}
    fires = right = positions = 0
    drafter_right_where_fires = drafter_right_elsewhere = 0
    for problem in tqdm(load_humaneval(args.prompts), desc="prompts"):
        prompt = pair.tokenizer(chat_prompt(pair.tokenizer, problem["prompt"]), add_special_tokens=False)["input_ids"]
        out = target.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, do_sample=False)
        seq = out[0].tolist()
        hidden = target(out, output_hidden_states=True).hidden_states
        feats = torch.stack([hidden[i + 1][0] for i in layers], 1)  # [T, F, H]
        history = TokenHistory(LOOKUP_WINDOW, args.ngram_order - 1)
        history.observe(0, seq[: len(prompt)])
        accepted: dict[str, dict[int, int]] = {m: {} for m in methods}
        end = len(seq) - 1  # the last token cannot be verified beyond max_new_tokens
        for p in range(len(prompt), end):  # p: the root (the last committed token)
            history.observe(0, seq[p : p + 1])
            truth = seq[p + 1 : p + drafter.cfg.block_size][: end - p]
            ids, pos = make_block(torch.tensor(seq[p : p + 1]), torch.tensor([p]), drafter.cfg.block_size)
            logits = drafter(ids, pos, context_features=feats[None, :p], context_positions=torch.arange(p)[None]).logits
            logits = logits[:, 1:].float()  # [1, W, V]
            chain = drafter.draft_to_target[logits[0].argmax(-1)].tolist()
            look, valid = history.continuation([0], args.lookup_tokens)
            lookup = look[0][valid[0]].tolist()
            top_logp, top_ids = topk_per_depth(logits, min(args.budget, logits.shape[-1]))
            tree = build_tree(top_logp, drafter.draft_to_target[top_ids], args.budget, max_budget=args.budget)
            both = add_branch(tree, look, valid, args.budget + args.lookup_tokens)
            for name, t in ((methods[2], tree), (methods[3], both)):
                n = int(t.num_nodes[0])
                accepted[name][p] = accepted_on_tree(t.tokens[0, :n].tolist(), t.parents[0, :n].tolist(), truth)
            accepted[methods[0]][p] = accepted_on_tree(chain, list(range(-1, len(chain) - 1)), truth)
            accepted[methods[1]][p] = accepted_on_tree(lookup, list(range(-1, len(lookup) - 1)), truth)
            positions += 1
            first_ok = bool(truth) and chain[0] == truth[0]
            if lookup:
                fires += 1
                right += bool(truth) and lookup[0] == truth[0]
                drafter_right_where_fires += first_ok
            else:
                drafter_right_elsewhere += first_ok
        for m in methods:
            steps[m] += stepped_tau(accepted[m], len(prompt), end)
    result = {
        "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "positions": positions,
        "lookup_fires": fires / positions, "lookup_first_token_right_where_it_fires": right / max(fires, 1),
        "drafter_first_token_right_where_lookup_fires": drafter_right_where_fires / max(fires, 1),
        "drafter_first_token_right_elsewhere": drafter_right_elsewhere / max(positions - fires, 1),
        "stepped_tau": {m: sum(s) / len(s) for m, s in steps.items()},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
