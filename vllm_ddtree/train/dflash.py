"""DFlash training recipe on self-distilled data (records from :mod:`vllm_ddtree.train.datagen`).

Per sequence, ``blocks_per_seq`` random anchors inside the response; each block is
``[token@anchor, MASK × 15]`` at positions ``anchor .. anchor+15``. All blocks of a batch run in
one forward: a boolean mask lets block b's queries see context columns ``< anchor_b`` and the
16 keys of block b itself (bidirectionally), never another block. Loss: cross-entropy on slots
1..15 against ``token[anchor + k]`` with weight ``exp(−(k−1)/γ)``, γ = 7 (slot 0 is the given
root). Labels outside the draft vocabulary are ignored by the loss (and count as misses in
accuracy).

    python -m vllm_ddtree.train.dflash --data runs/data --out runs/train --minutes 50

Resumable: ``--out`` holds ``state.pt`` (model, optimiser, step, elapsed time) written every
``--ckpt-every`` steps; rerunning the same command continues. ``train_log.jsonl`` logs loss.
Rerunning it with a larger ``--layers`` deepens the trained drafter (:func:`grow_layers`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_ddtree.drafter.model import DFlashDrafter, DrafterConfig

GAMMA = 7.0


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def max_ngram_repeats(tokens: list[int], n: int = 8) -> int:
    """How many times the most frequent n-token sequence of `tokens` occurs (0 if shorter than n)."""
    counts = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return max(counts.values(), default=0)


def drop_loops(records: list[dict], max_repeats: int, n: int = 8) -> tuple[list[dict], int]:
    """Records whose response repeats no n-gram `max_repeats` times or more, and how many were dropped.

    A 135M target's greedy responses often fall into loops (`benchmarks/loop_share.py`: 43% of our
    regenerated stdlib/site responses repeat an 8-gram 5+ times, 18% of its HumanEval outputs): easy
    tokens that take training steps and flatter held-out accuracy. Only the response counts.
    """
    kept = [r for r in records if max_ngram_repeats(r["tokens"][r["prompt_len"] :].tolist(), n) < max_repeats]
    return kept, len(records) - len(kept)


def is_heldout(rec: dict, frac: float = 0.04) -> bool:
    """Deterministic held-out split by prompt id."""
    return (zlib.crc32(str(rec["prompt_id"]).encode()) % 10000) < frac * 10000


def stdlib_token_counts(tokenizer) -> Counter:
    """Token counts of the standard library's source (the same files the prompts come from)."""
    from vllm_ddtree.train.prompts import stdlib_files

    texts = [f.read_text(encoding="utf-8", errors="ignore") for f in stdlib_files()]
    cnt: Counter = Counter()
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        cnt.update(ids)
    return cnt


def build_draft_vocab(records: list[dict], size: int, always: tuple[int, ...] = (2,),
                      extra_counts: Counter | list[tuple[Counter, float]] | None = None,
                      response_weight: float = 1.0) -> torch.Tensor:
    """The ``size`` highest-scoring tokens (sorted target ids), plus ``always``.

    Every id of ``always`` is kept, so passing an existing vocabulary as ``always`` extends it
    (used to measure coverage of larger vocabularies that keep the trained rows).

    Score = frequency among response tokens + frequency in ``extra_counts`` (stdlib source):
    the responses alone are too few to cover rare identifiers; mixing in a large code corpus
    lifted held-out coverage at 8192 rows from 92% to 99%. ``extra_counts`` may also be a list of
    ``(counts, weight)`` corpora; each corpus contributes ``weight`` × its relative frequency, the
    responses ``response_weight`` × theirs.
    """
    cnt: Counter = Counter()
    for r in records:
        cnt.update(r["tokens"][r["prompt_len"]:].tolist())
    if extra_counts is None or isinstance(extra_counts, Counter):
        extra_counts = [(extra_counts or Counter(), 1.0)]
    score: Counter = Counter()
    for c, w in [(cnt, response_weight), *extra_counts]:
        n = max(sum(c.values()), 1)
        for t, v in c.items():
            score[t] += w * v / n
    ids = list(dict.fromkeys(always))
    seen = set(ids)
    for t, _ in score.most_common():
        if len(ids) >= size:
            break
        if t not in seen:
            ids.append(t)
            seen.add(t)
    # Fill up with low ids if the data has fewer distinct tokens than `size`.
    t = 0
    while len(ids) < size:
        if t not in seen:
            ids.append(t)
        t += 1
    return torch.tensor(sorted(ids), dtype=torch.long)


def coverage(records: list[dict], vocab: torch.Tensor) -> float:
    """Fraction of response tokens whose id is in ``vocab``."""
    inv = set(vocab.tolist())
    tot = hit = 0
    for r in records:
        toks = r["tokens"][r["prompt_len"]:].tolist()
        tot += len(toks)
        hit += sum(t in inv for t in toks)
    return hit / max(tot, 1)


def _kept_rows(old_vocab: torch.Tensor, new_vocab: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows of ids in both vocabularies: (their indices in new_vocab, their indices in old_vocab)."""
    pos_old = {int(t): i for i, t in enumerate(old_vocab.tolist())}
    kept_new = [j for j, t in enumerate(new_vocab.tolist()) if int(t) in pos_old]
    return kept_new, [pos_old[int(new_vocab[j])] for j in kept_new]


def remap_draft_vocab(model_sd: dict, old_vocab: torch.Tensor, new_vocab: torch.Tensor,
                      embed_tokens: torch.Tensor) -> dict:
    """A drafter state dict re-targeted from ``old_vocab`` to ``new_vocab`` (sorted target ids).

    Rows of ids in both vocabularies are kept as they are (whatever training did to them); a new
    id's row is the target's tied embedding row, scaled by the mean ratio of the kept rows' norms
    to their own embedding rows' norms (exactly 1 when the head was frozen at its embedding init,
    as in the default recipe). ``d2t`` is rebuilt for ``new_vocab``. Other entries are untouched.
    """
    sd = dict(model_sd)
    w_old = sd["lm_head.weight"]
    emb = embed_tokens.to(w_old.dtype)
    kept_new, kept_old = _kept_rows(old_vocab, new_vocab)
    if kept_old:
        ratio = (w_old[kept_old].norm(dim=-1) / emb[old_vocab[kept_old]].norm(dim=-1).clamp(min=1e-12)).mean()
    else:
        ratio = torch.tensor(1.0, dtype=w_old.dtype)
    w_new = emb[new_vocab] * ratio
    w_new[kept_new] = w_old[kept_old]
    sd["lm_head.weight"] = w_new
    sd["d2t"] = new_vocab.long() - torch.arange(len(new_vocab))
    return sd


def widen_to_target_head(model: DFlashDrafter) -> DFlashDrafter:
    """The same drafter over the target's full vocabulary: rows of the draft vocabulary kept, every
    other row from the target's tied embeddings (see :func:`remap_draft_vocab`). With the default
    frozen head the result's LM head *is* the target's, so it is not stored on export and vLLM
    shares the target's head: 100% coverage at no checkpoint size."""
    cfg = DrafterConfig(**{**asdict(model.cfg), "draft_vocab_size": model.cfg.vocab_size})
    emb = model.embed_tokens
    wide = DFlashDrafter(cfg, emb)
    sd = remap_draft_vocab(model.state_dict(), model.draft_to_target, torch.arange(cfg.vocab_size), emb)
    wide.load_state_dict(sd)
    return wide


def _remap_head_optimizer_state(opt_sd: dict, head_index: int, old_vocab: torch.Tensor,
                                new_vocab: torch.Tensor) -> dict:
    """Adam moments of a trained LM head moved to the new rows (zeros for new ids)."""
    st = opt_sd["state"].get(head_index)
    if not st:
        return opt_sd
    kept_new, kept_old = _kept_rows(old_vocab, new_vocab)
    for k in ("exp_avg", "exp_avg_sq"):
        v = st[k]
        nv = v.new_zeros((len(new_vocab), *v.shape[1:]))
        nv[kept_new] = v[kept_old]
        st[k] = nv
    return opt_sd


def grow_layers(model: DFlashDrafter, model_sd: dict, opt_sd: dict, params: list[torch.nn.Parameter]) -> tuple[dict, dict]:
    """Deepen a trained drafter on resume (``--layers`` above the checkpoint's): a state dict and an
    AdamW state for ``model``, which has more layers than ``model_sd``.

    The trained layers keep their weights; each new layer keeps ``model``'s initialisation (the
    target's next layer, see :func:`init_from_target`) with ``o_proj`` and ``down_proj`` zeroed, so it
    adds nothing to the residual stream: the grown drafter computes exactly what the trained one
    did, and training goes on from there instead of from scratch. Adam moments follow their
    parameters by name; new parameters start without any. ``params``: the optimiser's parameters,
    in its order.
    """
    sd = model.state_dict()
    missing = [k for k in model_sd if k not in sd]
    if missing:
        raise ValueError(f"checkpoint has entries the grown drafter lacks: {missing[:4]}; "
                         "--layers can only add layers")
    new_keys = [k for k in sd if k not in model_sd]
    sd.update(model_sd)
    for k in new_keys:
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            sd[k] = torch.zeros_like(sd[k])
    names = {id(p): n for n, p in model.named_parameters()}
    new_names = [names[id(p)] for p in params]
    old_names = [n for n in new_names if n in model_sd]  # new layers come after the old ones: same order
    where = {n: i for i, n in enumerate(new_names)}
    state = {where[old_names[i]]: st for i, st in opt_sd["state"].items()}
    groups = [{**opt_sd["param_groups"][0], "params": list(range(len(new_names)))}]
    return sd, {"state": state, "param_groups": groups}


@dataclass
class Batch:
    """One training batch of blocks over several sequences."""

    features: torch.Tensor  # [B, T, F, H] float32 (T = longest context with features)
    ctx_positions: torch.Tensor  # [B, T]
    block_ids: torch.Tensor  # [B, Q]  Q = nb * bs
    block_positions: torch.Tensor  # [B, Q]
    labels: torch.Tensor  # [B, Q] draft-vocab ids, -100 = ignore (also slot 0)
    target_labels: torch.Tensor  # [B, Q] target ids, -1 = none (for accuracy)
    slot: torch.Tensor  # [B, Q] slot index k in 0..bs-1
    mask: torch.Tensor  # [B, Q, T + Q] bool
    soft_ids: torch.Tensor | None = None  # [B, Q, K] draft-vocab ids of the target's top-K, 0 where unused
    soft_p: torch.Tensor | None = None  # [B, Q, K] their probabilities, renormalised; 0 where unused


def make_batch(
    recs: list[dict], cfg: DrafterConfig, t2d: torch.Tensor, blocks_per_seq: int, rng: random.Random,
    feature_index: list[int], all_anchors: bool = False, soft: bool = False,
) -> Batch:
    """Sample anchors and build the block mask. ``t2d`` maps target id → draft id (−100 if absent).

    ``soft``: also the target's next-token distribution at every labelled slot (records with
    ``teacher_ids``/``teacher_logp`` from ``extract --teacher-topk``), restricted to the draft
    vocabulary and renormalised over its top K."""
    bs = cfg.block_size
    anchors_per: list[list[int]] = []
    for r in recs:
        n, pl = len(r["tokens"]), r["prompt_len"]
        cand = list(range(pl, n - 1))  # anchor needs at least one label after it
        if all_anchors:
            a = cand
        else:
            a = sorted(rng.sample(cand, min(blocks_per_seq, len(cand))))
        anchors_per.append(a)
    nb = max(len(a) for a in anchors_per)
    T = max(len(r["tokens"]) - 1 for r in recs)
    B, Q = len(recs), nb * bs
    H = cfg.hidden_size
    feats = torch.zeros((B, T, len(feature_index), H), dtype=torch.float32)
    block_ids = torch.full((B, Q), cfg.mask_token_id, dtype=torch.long)
    block_pos = torch.zeros((B, Q), dtype=torch.long)
    labels = torch.full((B, Q), -100, dtype=torch.long)
    tlabels = torch.full((B, Q), -1, dtype=torch.long)
    slot = torch.arange(bs).repeat(nb)[None].expand(B, Q).clone()
    mask = torch.zeros((B, Q, T + Q), dtype=torch.bool)
    K = recs[0]["teacher_ids"].shape[-1] if soft else 0
    soft_ids = torch.zeros((B, Q, K), dtype=torch.long)
    soft_p = torch.zeros((B, Q, K), dtype=torch.float32)
    ar = torch.arange(bs)
    for i, (r, anc) in enumerate(zip(recs, anchors_per)):
        toks = r["tokens"].long()
        f = r["features"]
        feats[i, : f.shape[0]] = f[:, feature_index].float()
        n = len(toks)
        for b, a in enumerate(anc):
            s = slice(b * bs, (b + 1) * bs)
            block_ids[i, b * bs] = toks[a]
            block_pos[i, s] = a + ar
            idx = a + ar[1:]
            ok = idx < n
            tl = torch.full((bs - 1,), -1, dtype=torch.long)
            tl[ok] = toks[idx[ok]]
            tlabels[i, b * bs + 1 : (b + 1) * bs] = tl
            dl = torch.where(tl >= 0, t2d[tl.clamp(min=0)], torch.full_like(tl, -100))
            labels[i, b * bs + 1 : (b + 1) * bs] = dl
            if soft:  # teacher row of token j is j - prompt_len - 1
                rows = (idx[ok] - r["prompt_len"] - 1).long()
                tid = r["teacher_ids"][rows].long()
                d = t2d[tid]
                p = r["teacher_logp"][rows].float().exp() * (d >= 0)
                p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
                q = slice(b * bs + 1, b * bs + 1 + int(ok.sum()))
                soft_ids[i, q] = d.clamp(min=0)
                soft_p[i, q] = p
            mask[i, s, :a] = True  # context strictly before the anchor
            mask[i, s, T + b * bs : T + (b + 1) * bs] = True  # its own block, bidirectional
        if len(anc) < nb:  # padding blocks: let them see one key so softmax stays finite
            mask[i, len(anc) * bs :, T + len(anc) * bs :] = True
    ctx_pos = torch.arange(T)[None].expand(B, T)
    return Batch(feats, ctx_pos, block_ids, block_pos, labels, tlabels, slot, mask,
                 soft_ids if soft else None, soft_p if soft else None)


def slot_weights(bs: int, gamma: float = GAMMA) -> torch.Tensor:
    """Loss weight per slot: 0 for the root, exp(−(k−1)/γ) for k ≥ 1."""
    k = torch.arange(bs, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def forward_batch(model: DFlashDrafter, batch: Batch) -> torch.Tensor:
    """Draft-vocabulary logits [B, Q, V_d] for a batch."""
    fused = model.fuse_features(batch.features.flatten(-2))
    kv = model.context_kv(fused, batch.ctx_positions)
    return model.run_blocks(batch.block_ids, batch.block_positions, kv, batch.mask).logits


def block_loss(logits: torch.Tensor, batch: Batch, weights: torch.Tensor, kd_weight: float = 0.0) -> torch.Tensor:
    """Weighted CE over slots 1..bs−1 (normalised by the total weight of valid slots).

    ``kd_weight`` α > 0 mixes in distillation: (1 − α) · CE against the target's token + α · CE
    against the target's own (top-K, renormalised) next-token distribution there (``batch.soft_*``),
    which also ranks the alternatives a tree drafts."""
    w = weights[batch.slot] * (batch.labels >= 0)
    logp = torch.log_softmax(logits.float(), -1)
    ce = -logp.gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
    if kd_weight > 0:
        soft = -(logp.gather(-1, batch.soft_ids) * batch.soft_p).sum(-1)
        ce = (1 - kd_weight) * ce + kd_weight * soft
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


# ---------------------------------------------------------------------------------------------
# init from the target (docs/design.md §15)
# ---------------------------------------------------------------------------------------------
def init_from_target(model: DFlashDrafter, target_sd: dict, draft_vocab: torch.Tensor, copy_layers: bool = True) -> None:
    """Copy the target's top layers into the drafter, make ``fc`` pass the top feature through,
    and set the LM head to the target's (tied) embedding rows of the draft vocabulary.
    With ``copy_layers=False`` the decoder layers and ``fc`` keep their random init."""
    cfg = model.cfg
    Lt = cfg.num_target_layers
    top = cfg.target_layer_ids[-1]  # features = output of layer `top` = input of layer top+1
    with torch.no_grad():
        for i, layer in enumerate(model.layers if copy_layers else []):
            src = min(top + 1 + i, Lt - 1)
            p = f"model.layers.{src}."
            a = layer.self_attn
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(a, n).weight.copy_(target_sd[p + f"self_attn.{n}.weight"])
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, n).weight.copy_(target_sd[p + f"mlp.{n}.weight"])
            layer.input_layernorm.weight.copy_(target_sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(target_sd[p + "post_attention_layernorm.weight"])
        H = cfg.hidden_size
        if copy_layers:
            model.fc.weight.zero_()
            model.fc.weight[:, (cfg.num_features - 1) * H :] = torch.eye(H)
        else:
            for layer in model.layers:  # small init keeps the residual stream near the embeddings
                for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    lin.weight.mul_(0.5)
        model.hidden_norm.weight.copy_(target_sd[f"model.layers.{min(top + 1, Lt - 1)}.input_layernorm.weight"])
        model.norm.weight.copy_(target_sd["model.norm.weight"])
        emb = target_sd["model.embed_tokens.weight"].float()
        model.lm_head.weight.copy_(emb[draft_vocab])
        model.d2t.copy_(draft_vocab - torch.arange(len(draft_vocab)))


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    """Held-out per-depth top-1 accuracy and the implied chain acceptance."""

    per_depth_top1: list[float]  # depth k = 1..bs-1
    mean_accepted: float  # mean run of consecutive correct slots from depth 1 (τ − 1 estimate)
    tau_estimate: float
    blocks: int
    loss: float


@torch.no_grad()
def evaluate(model: DFlashDrafter, recs: list[dict], t2d: torch.Tensor, feature_index: list[int],
             max_blocks_per_seq: int = 64, seed: int = 0) -> EvalResult:
    """Top-1 accuracy per depth over held-out records (anchors sampled, fixed seed)."""
    model.eval()
    cfg = model.cfg
    bs = cfg.block_size
    rng = random.Random(seed)
    w = slot_weights(bs)
    correct = torch.zeros(bs)
    count = torch.zeros(bs)
    runs: list[int] = []
    losses = []
    d2t_full = model.draft_to_target
    for i in range(0, len(recs), 2):
        batch = make_batch(recs[i : i + 2], cfg, t2d, max_blocks_per_seq, rng, feature_index)
        logits = forward_batch(model, batch)
        losses.append(float(block_loss(logits, batch, w)))
        pred = d2t_full[logits.argmax(-1)]  # target ids
        ok = (pred == batch.target_labels) & (batch.target_labels >= 0)
        valid = batch.target_labels >= 0
        B, Q = pred.shape
        okb = ok.view(B, Q // bs, bs)[..., 1:]
        vb = valid.view(B, Q // bs, bs)[..., 1:]
        correct[1:] += okb.sum((0, 1)).float()
        count[1:] += vb.sum((0, 1)).float()
        real = vb[..., 0]  # blocks that exist
        run = okb.long().cumprod(-1).sum(-1)
        runs.extend(run[real].tolist())
    model.train()
    acc = (correct[1:] / count[1:].clamp(min=1)).tolist()
    mean_run = sum(runs) / max(len(runs), 1)
    return EvalResult(acc, mean_run, 1 + mean_run, len(runs), sum(losses) / max(len(losses), 1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def leak_filter(records: list[dict], target_dir) -> tuple[list[dict], dict]:
    """Drop records whose decoded text contains a HumanEval signature or solution n-gram."""
    from transformers import AutoTokenizer

    from vllm_ddtree.data.humaneval import load_humaneval
    from vllm_ddtree.train.contamination import find_leaks

    tok = AutoTokenizer.from_pretrained(target_dir)
    texts = [tok.decode(r["tokens"].tolist()) for r in records]
    leaks = find_leaks(texts, load_humaneval())
    bad = {l.index for l in leaks}
    kept = [r for i, r in enumerate(records) if i not in bad]
    modes = Counter(r.get("mode", "?") for r in kept)
    manifest = {
        "sequences_generated": len(records),
        "modes": dict(modes),
        "leak_check": {"dropped": len(bad), "dropped_tasks": sorted({l.task_id for l in leaks}),
                       "leaks_in_training_data": 0},
    }
    return kept, manifest


@dataclass
class TrainingData:
    """Training and held-out records with the manifest of how they were filtered."""

    train: list[dict]
    held: list[dict]
    manifest: dict


def empty_training_data(drop_loops_repeats: int) -> TrainingData:
    """No records yet; the manifest has every key ``add_shard`` sums into."""
    manifest = {"sequences_generated": 0, "modes": {},
                "leak_check": {"dropped": 0, "dropped_tasks": [], "leaks_in_training_data": 0, "texts_checked": 0}}
    if drop_loops_repeats:
        manifest["loop_filter"] = {"ngram": 8, "max_repeats": drop_loops_repeats, "dropped": 0}
    return TrainingData([], [], manifest)


def add_shard(data: TrainingData, shard: Path, target_dir, drop_loops_repeats: int) -> None:
    """Leak-filter one shard, split it, drop looping training records, and add what is left to ``data``.

    Shard by shard so that memory holds the kept records plus one shard: loading every shard
    before filtering held the ~35% of records the loop filter drops too, and that peak, not
    the kept data, limited how many shards could train together."""
    recs, man = leak_filter(torch.load(shard, weights_only=False), target_dir)
    train = [r for r in recs if not is_heldout(r)]
    data.held.extend(r for r in recs if is_heldout(r))
    m = data.manifest
    if drop_loops_repeats:
        train, dropped = drop_loops(train, drop_loops_repeats)
        m["loop_filter"]["dropped"] += dropped
    data.train.extend(train)
    m["sequences_generated"] += man["sequences_generated"]
    for k, v in man["modes"].items():
        m["modes"][k] = m["modes"].get(k, 0) + v
    m["leak_check"]["dropped"] += man["leak_check"]["dropped"]
    m["leak_check"]["dropped_tasks"] = sorted(set(m["leak_check"]["dropped_tasks"]) | set(man["leak_check"]["dropped_tasks"]))
    m["leak_check"]["texts_checked"] = len(data.train)
    m["train_sequences"] = len(data.train)
    m["heldout_sequences"] = len(data.held)
    m["train_response_tokens"] = sum(len(r["tokens"]) - r["prompt_len"] for r in data.train)
    m["train_tokens_total"] = sum(len(r["tokens"]) for r in data.train)


# ---------------------------------------------------------------------------------------------
# main loop
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="runs/data")
    ap.add_argument("--out", default="runs/train")
    ap.add_argument("--minutes", type=float, default=50.0, help="training time budget (lr schedule spans it)")
    ap.add_argument("--layers", type=int, default=1,
                    help="decoder layers; on resume, more than the checkpoint's grows it (grow_layers)")
    ap.add_argument("--target-layer-ids", default="1,8,14,20,27")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--vocab-file", default=None,
                    help="draft vocabulary to use (torch-saved sorted target ids, e.g. from vllm_ddtree.train.vocab); "
                         "on resume a different vocabulary re-targets the LM head (kept rows stay, new rows from "
                         "the target's embeddings)")
    ap.add_argument("--batch-seqs", type=int, default=4)
    ap.add_argument("--blocks-per-seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--train-lm-head", action="store_true")
    ap.add_argument("--gamma", type=float, default=GAMMA,
                    help="slot k's loss weight is exp(-(k-1)/gamma) (DFlash: 7 for block 16); smaller puts the "
                         "drafter's capacity on the first depths, which carry a chain's and a tree's acceptance")
    ap.add_argument("--kd-weight", type=float, default=0.0,
                    help="alpha of distillation against the target's top-K next-token distribution (data from "
                         "extract --teacher-topk): loss = (1 - alpha) CE(token) + alpha CE(target's distribution)")
    ap.add_argument("--init-from", default=None,
                    help="a saved drafter checkpoint (save_drafter format) to start from instead of the target's "
                         "layers (fresh optimiser; with more --layers it is grown as on resume)")
    ap.add_argument("--drop-loops", type=int, default=0, metavar="K",
                    help="leave out of training (not of the held-out set) every response that repeats some "
                         "8-token sequence K or more times; 0 keeps all")
    ap.add_argument("--init", choices=["target", "random"], default="target",
                    help="target: copy top target layers + pass-through fc; random: only norms/LM head from the target")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true",
                    help="run the drafter's forward under torch.autocast(bfloat16): weights, Adam state and the "
                         "loss stay float32. Pays on CPUs with avx512_bf16 or AMX (the toy drafter's run: 86 steps a minute against 47 in "
                         "float32, vllm_ddtree/checkpoints/smollm2-dflash/train_log.jsonl); elsewhere bf16 is emulated and slower")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export", default=None, help="after training, save the drafter here (bf16)")
    ap.add_argument("--export-shared-head", default=None,
                    help="also save it here over the target's full vocabulary, sharing the target's LM head "
                         "(widen_to_target_head)")
    ap.add_argument("--watch-pid", type=int, default=None,
                    help="a data producer still running: pick up its new shards every 100 steps, and raise "
                         "threads to --threads once it exits (until then use 1 thread to avoid contention)")
    args = ap.parse_args(argv)
    if args.drop_loops < 0 or args.drop_loops == 1:
        ap.error(f"--drop-loops must be 0 (off) or at least 2 repeats, got {args.drop_loops}")

    from safetensors.torch import load_file
    from tqdm import tqdm

    from vllm_ddtree.models.target import prepare_target

    producer_alive = args.watch_pid is not None and _alive(args.watch_pid)
    torch.set_num_threads(1 if producer_alive else args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((Path(args.data) / "meta.json").read_text())
    stored_ids = list(meta["feature_layer_ids"])
    layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
    feature_index = [stored_ids.index(i) for i in layer_ids]

    shards = sorted(Path(args.data).glob("shard_*.pt"))
    shard_names = {p.name for p in shards}
    tdir = prepare_target()
    data = empty_training_data(args.drop_loops)
    for p in tqdm(shards, desc="load shards", unit="shard"):
        add_shard(data, p, tdir, args.drop_loops)
    train_recs, held, manifest = data.train, data.held, data.manifest
    base_manifest = Path(args.init_from or "") / "data_manifest.json"
    if args.init_from and base_manifest.exists():  # the weights' earlier data stays on record
        manifest["init_from"] = json.loads(base_manifest.read_text())
    (out / "data_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    target_sd = load_file(str(Path(tdir) / "model.safetensors"))
    emb = target_sd["model.embed_tokens.weight"].float()

    state_path = out / "state.pt"
    resume = torch.load(state_path, weights_only=False) if state_path.exists() else None
    if args.vocab_file and Path(args.vocab_file).is_dir():  # a checkpoint's draft_vocab.json
        from vllm_ddtree.drafter.io import load_draft_vocab

        draft_vocab = load_draft_vocab(args.vocab_file, int(emb.shape[0]))
        if draft_vocab is None:
            raise SystemExit(f"--vocab-file {args.vocab_file}: a directory without draft_vocab.json")
    elif args.vocab_file:
        draft_vocab = torch.load(args.vocab_file, weights_only=False).long().sort().values
    elif resume:
        draft_vocab = resume["draft_vocab"]
    else:
        from transformers import AutoTokenizer

        extra = stdlib_token_counts(AutoTokenizer.from_pretrained(tdir))
        draft_vocab = build_draft_vocab(train_recs, args.draft_vocab, extra_counts=extra)
    cfg = DrafterConfig(num_hidden_layers=args.layers, target_layer_ids=layer_ids,
                        draft_vocab_size=len(draft_vocab))
    t2d = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
    t2d[draft_vocab] = torch.arange(len(draft_vocab))
    model = DFlashDrafter(cfg, emb)
    init_from_target(model, target_sd, draft_vocab, copy_layers=args.init == "target")
    model.lm_head.weight.requires_grad_(args.train_lm_head)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    step, elapsed = 0, 0.0
    if args.init_from and not resume:
        from vllm_ddtree.drafter.io import load_drafter

        init = load_drafter(args.init_from, emb, draft_vocab="full")
        if init.cfg.target_layer_ids != layer_ids:
            raise SystemExit(f"--init-from {args.init_from} reads target layers {init.cfg.target_layer_ids}, "
                             f"not --target-layer-ids {layer_ids}")
        resume = {"model": init.float().state_dict(), "opt": {"state": {}, "param_groups": opt.state_dict()["param_groups"]},
                  "draft_vocab": init.draft_to_target, "step": 0, "elapsed": 0.0}
        print(f"starting from {args.init_from} ({init.cfg.num_hidden_layers} layers)", flush=True)
    if resume:
        old_vocab = resume["draft_vocab"]
        msd, osd = resume["model"], resume["opt"]
        if not torch.equal(old_vocab, draft_vocab):
            msd = remap_draft_vocab(msd, old_vocab, draft_vocab, emb)
            if model.lm_head.weight.requires_grad:
                head_index = next(i for i, p in enumerate(params) if p is model.lm_head.weight)
                osd = _remap_head_optimizer_state(osd, head_index, old_vocab, draft_vocab)
        resumed_layers = 1 + max(int(k.split(".")[1]) for k in msd if k.startswith("layers."))
        if resumed_layers > cfg.num_hidden_layers:
            raise ValueError(f"{state_path} has {resumed_layers} layers but --layers is {cfg.num_hidden_layers}; "
                             f"pass --layers {resumed_layers} or more")
        if resumed_layers < cfg.num_hidden_layers:
            msd, osd = grow_layers(model, msd, osd, params)
            print(f"grew the drafter from {resumed_layers} to {cfg.num_hidden_layers} layers", flush=True)
        model.load_state_dict(msd)
        opt.load_state_dict(osd)
        step, elapsed = resume["step"], resume["elapsed"]
    log = open(out / "train_log.jsonl", "a")
    info = {"event": "start", "step": step, "train_seqs": len(train_recs), "heldout_seqs": len(held),
            "train_resp_tokens": sum(len(r["tokens"]) - r["prompt_len"] for r in train_recs),
            "draft_vocab": len(draft_vocab), "coverage_train": coverage(train_recs, draft_vocab),
            "coverage_heldout": coverage(held, draft_vocab), "args": vars(args), "cfg": asdict(cfg)}
    log.write(json.dumps(info) + "\n")
    log.flush()
    print(json.dumps({k: v for k, v in info.items() if k not in ("cfg",)}), flush=True)

    weights = slot_weights(cfg.block_size, args.gamma)
    if args.kd_weight > 0 and not all("teacher_ids" in r for r in train_recs):
        raise SystemExit("--kd-weight needs records with the target's distribution: extract with --teacher-topk")
    rng = random.Random(args.seed * 1000 + step)
    budget = args.minutes * 60
    warmup = 50
    order: list[int] = []
    bar = tqdm(total=int(budget), unit="s", initial=int(elapsed), desc="train", mininterval=10)
    ema = None
    t_last = time.time()
    best_score = -1.0
    if (out / "best.pt").exists():
        best_score = torch.load(out / "best.pt", weights_only=False)["eval"]["mean_accepted"]

    def save_state() -> None:
        tmp = out / "state.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "draft_vocab": draft_vocab, "args": vars(args)}, tmp)
        os.replace(tmp, state_path)

    while elapsed < budget:
        if producer_alive and step % 100 == 0:
            # Pick up shards the producer finished since the start (same leak filter, same split).
            new = sorted(p for p in Path(args.data).glob("shard_*.pt") if p.name not in shard_names)
            for p in new:
                shard_names.add(p.name)
                add_shard(data, p, tdir, args.drop_loops)
                (out / "data_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
                log.write(json.dumps({"event": "new_shard", "step": step, "shard": p.name,
                                      "train_seqs": len(train_recs), "heldout_seqs": len(held)}) + "\n")
                log.flush()
                order = []  # reshuffle including the new sequences
            if not _alive(args.watch_pid):
                producer_alive = False
                torch.set_num_threads(args.threads)
                log.write(json.dumps({"event": "producer_done", "step": step, "threads": args.threads}) + "\n")
                log.flush()
        if len(order) < args.batch_seqs:
            order = list(range(len(train_recs)))
            rng.shuffle(order)
        idx, order = order[: args.batch_seqs], order[args.batch_seqs :]
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = make_batch([train_recs[i] for i in idx], cfg, t2d, args.blocks_per_seq, rng, feature_index,
                           soft=args.kd_weight > 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = forward_batch(model, batch)
        loss = block_loss(logits, batch, weights, args.kd_weight)  # float32: block_loss upcasts the logits
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        now = time.time()
        elapsed += now - t_last
        bar.update(int(elapsed) - bar.n)
        t_last = now
        lv = float(loss.detach())
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        if step % 10 == 0:
            log.write(json.dumps({"step": step, "elapsed": round(elapsed, 1), "loss": round(lv, 4),
                                  "loss_ema": round(ema, 4), "lr": lr}) + "\n")
            log.flush()
            bar.set_postfix(step=step, loss=f"{ema:.3f}")
        if step % args.ckpt_every == 0:
            save_state()
        if args.eval_every and step % args.eval_every == 0 and held:
            t_ev = time.time()
            ev = evaluate(model, held[:48], t2d, feature_index)
            log.write(json.dumps({"step": step, "eval": asdict(ev)}) + "\n")
            log.flush()
            # Keep the best held-out state: with little data the drafter can overfit late.
            if ev.mean_accepted > best_score:
                best_score = ev.mean_accepted
                torch.save({"model": model.state_dict(), "step": step, "eval": asdict(ev)}, out / "best.pt")
            t_last += time.time() - t_ev  # evaluation time does not count against the budget
    bar.close()
    save_state()
    ev = evaluate(model, held, t2d, feature_index)
    if (out / "best.pt").exists():
        best = torch.load(out / "best.pt", weights_only=False)
        last_sd = model.state_dict()
        model.load_state_dict(best["model"])
        ev_best = evaluate(model, held, t2d, feature_index)
        if ev_best.mean_accepted > ev.mean_accepted:
            log.write(json.dumps({"event": "use_best", "best_step": best["step"], "final_step": step,
                                  "final_eval_mean_accepted": ev.mean_accepted}) + "\n")
            ev = ev_best
        else:
            model.load_state_dict(last_sd)
    final = {"event": "final", "step": step, "elapsed": elapsed, "eval": asdict(ev)}
    log.write(json.dumps(final) + "\n")
    log.close()
    print(json.dumps(final), flush=True)
    if args.export:
        export(model, out, args.export, held, t2d, feature_index)
    if args.export_shared_head:
        export(widen_to_target_head(model), out, args.export_shared_head, held, t2d, feature_index)


def export(model: DFlashDrafter, run_dir: Path, dest: str | Path, held: list[dict], t2d: torch.Tensor,
           feature_index: list[int]) -> dict:
    """Save the drafter (bf16) plus its training log, data manifest and held-out eval (of the
    *saved*, bf16-rounded weights) into ``dest``."""
    import shutil

    from vllm_ddtree.drafter.io import load_drafter, save_drafter

    dest = Path(dest)
    save_drafter(model, dest)
    reloaded = load_drafter(dest, model.embed_tokens)
    t2d = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)  # the saved model's own vocabulary
    t2d[reloaded.draft_to_target] = torch.arange(reloaded.cfg.draft_vocab_size)
    ev = evaluate(reloaded, held, t2d, feature_index)
    (dest / "heldout_eval.json").write_text(json.dumps(asdict(ev), indent=2) + "\n")
    for name in ("train_log.jsonl", "data_manifest.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, dest / name)
    return asdict(ev)


if __name__ == "__main__":
    main()
