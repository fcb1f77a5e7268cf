"""Draft vocabulary from offline, non-HumanEval sources: the target's training responses plus two
Python corpora on this machine (the standard library and the venv's site-packages ``.py`` files).

Score of a token = Σ_source weight × (its relative frequency in that source). The responses are the
target's own outputs (the distribution to cover) but too few for rare identifiers; the corpora fill
in the tail. Held-out prompts (``dflash.is_heldout``) are excluded from the counts and used to report
coverage. ``--keep`` extends an existing vocabulary (its ids always stay).

    python -m vllm_ddtree.train.vocab --gen runs/gen --size 12480 --keep runs/train2/state.pt \\
        --out runs/vocab_12480.pt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from collections import Counter
from pathlib import Path

import torch

from vllm_ddtree.train.dflash import build_draft_vocab, coverage, is_heldout


def corpus_files(kind: str) -> list[Path]:
    """``stdlib``: the files the prompts come from; ``site``: every .py file of the running
    environment's site-packages (sorted), minus anything with HumanEval in its path."""
    if kind == "stdlib":
        from vllm_ddtree.train.prompts import stdlib_files

        files = stdlib_files()
    else:
        files = sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py"))
    return [f for f in files if "humaneval" not in str(f).lower().replace("_", "")]


def corpus_token_counts(tokenizer, files: list[Path], cap_bytes: int = 100_000) -> Counter:
    """Token counts over ``files`` (first ``cap_bytes`` of each; byte-identical files counted once,
    so vendored copies and huge generated tables do not dominate)."""
    cnt: Counter = Counter()
    seen: set[bytes] = set()
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            cnt.update(ids)
        batch.clear()

    for f in files:
        try:
            b = f.read_bytes()[:cap_bytes]
        except OSError:
            continue
        h = hashlib.sha1(b).digest()
        if h in seen:
            continue
        seen.add(h)
        batch.append(b.decode("utf-8", errors="ignore"))
        if len(batch) == 256:
            flush()
    if batch:
        flush()
    return cnt


def response_records(gen_dirs: list[str], extra_shards: list[str] = ()) -> list[dict]:
    """``{tokens, prompt_len, prompt_id}`` of every generated response (jsonl chunks and
    optional feature shards, whose features are dropped)."""
    recs: list[dict] = []
    for d in gen_dirs:
        for f in sorted(Path(d).glob("responses_*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    recs.append({"tokens": torch.tensor(r["prompt_ids"] + r["response_ids"]),
                                 "prompt_len": len(r["prompt_ids"]), "prompt_id": r["prompt_id"]})
    for s in extra_shards:
        for r in torch.load(s, weights_only=False):
            recs.append({"tokens": r["tokens"], "prompt_len": r["prompt_len"], "prompt_id": r["prompt_id"]})
    return recs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen", nargs="+", default=["runs/gen"])
    ap.add_argument("--extra-shards", nargs="*", default=["runs/data/shard_00033.pt"])
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--keep", default=None, help="a dflash state.pt (or a saved id tensor) whose vocabulary is kept")
    ap.add_argument("--w-resp", type=float, default=1.0)
    ap.add_argument("--w-stdlib", type=float, default=1.0)
    ap.add_argument("--w-site", type=float, default=1.0)
    ap.add_argument("--counts-cache", default=None, help="pickle of the corpus counts (written if missing)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import pickle

    from transformers import AutoTokenizer

    from vllm_ddtree.models.target import prepare_target

    cache = Path(args.counts_cache) if args.counts_cache else None
    if cache and cache.exists():
        corp = pickle.loads(cache.read_bytes())
    else:
        tok = AutoTokenizer.from_pretrained(prepare_target())
        corp = {k: corpus_token_counts(tok, corpus_files(k)) for k in ("stdlib", "site")}
        if cache:
            cache.write_bytes(pickle.dumps(corp))
    recs = response_records(args.gen, [s for s in args.extra_shards if Path(s).exists()])
    train = [r for r in recs if not is_heldout(r)]
    held = [r for r in recs if is_heldout(r)]
    always: tuple[int, ...] = (2,)
    if args.keep:
        k = torch.load(args.keep, weights_only=False)
        always = tuple((k["draft_vocab"] if isinstance(k, dict) else k).tolist())
    vocab = build_draft_vocab(train, args.size, always=always, response_weight=args.w_resp,
                              extra_counts=[(corp["stdlib"], args.w_stdlib), (corp["site"], args.w_site)])
    torch.save(vocab, args.out)
    info = {"size": len(vocab), "train_responses": len(train), "heldout_responses": len(held),
            "coverage_heldout": coverage(held, vocab), "weights": [args.w_resp, args.w_stdlib, args.w_site],
            "kept": len(always)}
    print(json.dumps(info))


if __name__ == "__main__":
    main()
