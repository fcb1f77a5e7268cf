"""Self-distillation data: the target's own responses plus its hidden states, in one pass.

Batched transformers generation (float32) captures the target's hidden states of the layers
the drafter reads *while* generating, so no second feature-extraction pass is needed
(docs/design.md §15: generating with vLLM and re-running the target for features costs twice).
Left padding with explicit position ids keeps every row's features independent of padding.

Output: ``shard_XXXXX.pt`` files, each a list of records
``{"tokens": int32[T], "prompt_len": int, "features": float16[T, F, H], "mode": str, "prompt_id": int}``
where ``features[t, j]`` is ``hidden_states[FEATURE_LAYER_IDS[j] + 1]`` at position ``t``
(the last generated token has no features: it was never fed back). Resumable: existing shards
are skipped.

    python -m vllm_ddtree.train.datagen --out runs/data --minutes 60
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Target layers whose outputs are stored (transformers' hidden_states[id + 1]). A superset of
# what a drafter may use: DFlash's default spacing for 5 ids on a 30-layer target.
FEATURE_LAYER_IDS = (1, 8, 14, 20, 27)
EOS_ID = 2  # <|im_end|>


@dataclass
class GenStats:
    """Running totals of a generation run."""

    sequences: int = 0
    response_tokens: int = 0
    total_tokens: int = 0
    seconds: float = 0.0


def _half(x: torch.Tensor) -> torch.Tensor:
    # Massive activations (~2.5e4 at the first position) come close to float16's range: clamp.
    return x.clamp(-65000.0, 65000.0).half()


def _batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    # Sort by prompt length so left padding wastes little compute.
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@torch.no_grad()
def generate_batch(
    model, prompt_ids: list[list[int]], max_new: int, temperature: float, gen: torch.Generator
) -> list[dict]:
    """Generate for one batch; return records with tokens and captured features."""
    B = len(prompt_ids)
    L = max(len(p) for p in prompt_ids)
    ids = torch.full((B, L), EOS_ID, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                output_hidden_states=True, logits_to_keep=1)
    prompt_feats = _half(torch.stack([out.hidden_states[j + 1] for j in FEATURE_LAYER_IDS], 2))  # [B,L,F,H]
    pkv = out.past_key_values
    logits = out.logits[:, -1]
    new_tokens: list[torch.Tensor] = []
    step_feats: list[torch.Tensor] = []
    done = torch.zeros(B, dtype=torch.bool)
    cur_pos = pos[:, -1]
    for step in range(max_new):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, EOS_ID), nxt)
        new_tokens.append(nxt)
        done = done | (nxt == EOS_ID)
        if bool(done.all()) or step == max_new - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], 1)
        cur_pos = cur_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=cur_pos[:, None],
                    past_key_values=pkv, use_cache=True, output_hidden_states=True)
        pkv = out.past_key_values
        logits = out.logits[:, -1]
        step_feats.append(_half(torch.stack([out.hidden_states[j + 1][:, 0] for j in FEATURE_LAYER_IDS], 1)))
    gen_tok = torch.stack(new_tokens, 1)  # [B, N]
    gen_feat = torch.stack(step_feats, 1) if step_feats else prompt_feats[:, :0]  # [B, N-1, F, H]
    records = []
    for i, p in enumerate(prompt_ids):
        toks = gen_tok[i].tolist()
        n = toks.index(EOS_ID) + 1 if EOS_ID in toks else len(toks)  # keep the EOS token
        pf = prompt_feats[i, L - len(p) :]
        # features exist for generated tokens 0..N-2 (each was fed back), so n-1 rows.
        f = torch.cat([pf, gen_feat[i, : n - 1]], 0).clone()
        records.append({
            "tokens": torch.tensor(list(p) + toks[:n], dtype=torch.int32),
            "prompt_len": len(p),
            "features": f,
        })
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/data")
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=60.0, help="stop starting new batches after this")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-every", type=int, default=3, help="every k-th batch samples at T=1, others greedy")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.data.humaneval import chat_prompt
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.train.prompts import stdlib_prompts

    torch.set_num_threads(args.threads)
    tdir = prepare_target(args.cache_dir)
    tok = AutoTokenizer.from_pretrained(tdir)
    model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = stdlib_prompts()
    chats = [chat_prompt(tok, p) for p in prompts]
    ids = [tok(c, add_special_tokens=False)["input_ids"] for c in chats]
    keep = [i for i in range(len(ids)) if len(ids[i]) <= 384]
    batches = _batches([len(ids[i]) for i in keep], args.batch_size)
    # Interleave short and long batches deterministically so a time-capped run covers both.
    order = list(range(len(batches)))
    import random

    random.Random(0).shuffle(order)
    (out / "meta.json").write_text(json.dumps({"feature_layer_ids": FEATURE_LAYER_IDS, "eos_id": EOS_ID,
                                               "max_new": args.max_new, "num_prompts": len(keep)}))
    stats = GenStats()
    t0 = time.time()
    log = open(out / "datagen.log", "a")
    for bi, b in enumerate(order):
        shard = out / f"shard_{b:05d}.pt"
        if shard.exists():
            continue
        if time.time() - t0 > args.minutes * 60:
            break
        temp = 1.0 if b % args.sample_every == args.sample_every - 1 else 0.0
        members = [keep[k] for k in batches[b]]
        gen = torch.Generator().manual_seed(1000 + b)
        tb = time.time()
        recs = generate_batch(model, [ids[m] for m in members], args.max_new, temp, gen)
        for r, m in zip(recs, members):
            r["mode"] = "t1" if temp > 0 else "greedy"
            r["prompt_id"] = m
        tmp = shard.with_suffix(".tmp")
        torch.save(recs, tmp)
        os.replace(tmp, shard)
        dt = time.time() - tb
        ntok = sum(len(r["tokens"]) - r["prompt_len"] for r in recs)
        stats.sequences += len(recs)
        stats.response_tokens += ntok
        stats.total_tokens += sum(len(r["tokens"]) for r in recs)
        stats.seconds += dt
        msg = (f"{time.strftime('%H:%M:%S')} batch {b} T={temp} seqs={len(recs)} resp_tok={ntok} "
               f"{dt:.0f}s ({ntok / dt:.0f} resp tok/s) | total seqs={stats.sequences} "
               f"resp_tok={stats.response_tokens} all_tok={stats.total_tokens}")
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()


if __name__ == "__main__":
    main()
