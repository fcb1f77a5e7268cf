"""Stage 2 of self-distillation data: target features for generated responses (transformers, fp32).

Sequences are right-padded, so with plain causal attention every real token's hidden states are
exactly those of an unpadded forward (pads only come after it): no attention mask is needed.
Only the layers up to the deepest stored id run; forward hooks capture the layer outputs
(= transformers' ``hidden_states[id + 1]``). Records are written in the format of
:mod:`vllm_ddtree.train.datagen` (``shard_gXXXX.pt``); finished chunks are skipped.

With ``--teacher-topk K`` the whole target runs and each record also carries the target's own
next-token distribution over the response, for distillation (``train.dflash --kd-weight``):
``teacher_ids`` int32 [R, K] and ``teacher_logp`` float16 [R, K], the K most likely tokens and their
log-probabilities, where row r is the prediction of token ``prompt_len + 1 + r`` (made at position
``prompt_len + r``; R = response length − 1). K = 8 adds ~100 bytes per token to ~5.8 KB of features.

    python -m vllm_ddtree.train.extract --gen runs/gen --out runs/data
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from vllm_ddtree.train.datagen import EOS_ID, FEATURE_LAYER_IDS, _half


class FeatureExtractor:
    """Runs the target's first ``max(ids)+1`` layers (all of them when ``keep_all``, for the
    teacher's logits) and returns the stored layers' outputs."""

    def __init__(self, model, layer_ids=FEATURE_LAYER_IDS, keep_all: bool = False) -> None:
        self.inner = model.model
        self.head = model.lm_head
        self.layer_ids = list(layer_ids)
        if not keep_all:
            self.inner.layers = self.inner.layers[: max(self.layer_ids) + 1]
        self.last: torch.Tensor | None = None  # final normed hidden states of the last call (keep_all)
        self.keep_all = keep_all
        self._cap: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:
            self.inner.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def fn(_mod, _inp, out):
            self._cap[i] = out[0] if isinstance(out, tuple) else out
        return fn

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids → float16 features [B, T, F, H]."""
        self._cap.clear()
        out = self.inner(input_ids=ids, use_cache=False)
        self.last = out.last_hidden_state if self.keep_all else None
        return _half(torch.stack([self._cap[i] for i in self.layer_ids], 2))

    @torch.no_grad()
    def teacher_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-``k`` next-token ids (int32) and log-probabilities (float16) at each
        row of ``hidden`` [N, H] (final normed hidden states)."""
        logp = torch.log_softmax(self.head(hidden).float(), -1)
        top = logp.topk(k, -1)
        return top.indices.int(), top.values.half()


def extract_chunk(fx: FeatureExtractor, rows: list[dict], max_tokens: int = 6144, teacher_topk: int = 0) -> list[dict]:
    """Records (tokens, prompt_len, features, mode, prompt_id; teacher_ids/teacher_logp with
    ``teacher_topk``) for one jsonl chunk."""
    seqs = [(r, r["prompt_ids"] + r["response_ids"]) for r in rows if r["response_ids"]]
    seqs.sort(key=lambda x: len(x[1]))
    out: list[dict] = []
    i = 0
    while i < len(seqs):
        T = len(seqs[i][1])
        j = i
        while j < len(seqs) and (j - i + 1) * len(seqs[j][1]) <= max_tokens:
            j += 1
        j = max(j, i + 1)
        group = seqs[i:j]
        T = max(len(s) for _, s in group)
        ids = torch.full((len(group), T), EOS_ID, dtype=torch.long)
        for k, (_, s) in enumerate(group):
            ids[k, : len(s)] = torch.tensor(s)
        feats = fx(ids)
        for k, (r, s) in enumerate(group):
            rec = {
                "tokens": torch.tensor(s, dtype=torch.int32),
                "prompt_len": len(r["prompt_ids"]),
                # the last token's features are never needed (no block can use it as context)
                "features": feats[k, : len(s) - 1].clone(),
                "mode": r["mode"],
                "prompt_id": r["prompt_id"],
            }
            if teacher_topk:
                pl = len(r["prompt_ids"])
                rec["teacher_ids"], rec["teacher_logp"] = fx.teacher_topk(fx.last[k, pl : len(s) - 1], teacher_topk)
            out.append(rec)
        i = j
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen", default="runs/gen")
    ap.add_argument("--out", default="runs/data")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=1e9)
    ap.add_argument("--teacher-topk", type=int, default=0,
                    help="also store the target's top-K next-token log-probabilities over each response "
                         "(runs all layers and the LM head), for train.dflash --kd-weight")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from vllm_ddtree.models.target import prepare_target

    torch.set_num_threads(args.threads)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(prepare_target(), dtype=torch.float32).eval()
    fx = FeatureExtractor(model, keep_all=args.teacher_topk > 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = out / "meta.json"
    if not meta.exists():
        meta.write_text(json.dumps({"feature_layer_ids": FEATURE_LAYER_IDS, "eos_id": EOS_ID}))
    for path in sorted(Path(args.gen).glob("responses_*.jsonl")):
        shard = out / f"shard_g{path.stem.split('_')[1]}.pt"
        if shard.exists():
            continue
        if time.time() - t0 > args.minutes * 60:
            break
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        tb = time.time()
        recs = extract_chunk(fx, rows, teacher_topk=args.teacher_topk)
        tmp = shard.with_suffix(".tmp")
        torch.save(recs, tmp)
        os.replace(tmp, shard)
        n = sum(len(r["tokens"]) for r in recs)
        print(f"{time.strftime('%H:%M:%S')} {path.name}: {len(recs)} seqs {n} tok {time.time() - tb:.0f}s "
              f"({n / (time.time() - tb):.0f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
