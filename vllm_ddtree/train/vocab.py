"""Draft vocabulary from offline, non-HumanEval sources: the target's training responses plus two
Python corpora of the running environment (the standard library and the venv's site-packages ``.py`` files).

Score of a token = Σ_source weight × (its relative frequency in that source). The responses are the
target's own outputs (the distribution to cover) but too few for rare identifiers; the corpora fill
in the tail. Held-out prompts (``dflash.is_heldout``) are excluded from the counts and used to report
coverage. ``--keep`` extends an existing vocabulary (its ids always stay).

    python -m vllm_ddtree.train.vocab --gen runs/gen --size 12480 --keep runs/train2/state.pt \\
        --out runs/vocab_12480.pt

With no responses (``--gen`` directories absent) the ranking comes from the two corpora alone; that is
how the committed drafter's ``draft_vocab.json`` is made (its README has the command).
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


def corpus_counts(tokenizer, cache: str | Path | None = None) -> dict[str, Counter]:
    """``{"stdlib": counts, "site": counts}`` (see :func:`corpus_token_counts`), cached as a pickle
    (default: next to the prepared target in the cache directory) because the site corpus takes
    about a minute to tokenize."""
    import pickle

    from vllm_ddtree.models.target import default_cache_dir

    cache = Path(cache) if cache else default_cache_dir() / f"corpus_counts_{len(tokenizer)}.pkl"
    if cache.is_file():
        return pickle.loads(cache.read_bytes())
    counts = {k: corpus_token_counts(tokenizer, corpus_files(k)) for k in ("stdlib", "site")}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_bytes(pickle.dumps(counts))
    return counts


def ranked_vocab(counts: dict[str, Counter], size: int, always: tuple[int, ...] = (2,),
                 records: list[dict] = (), weights: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> torch.Tensor:
    """The ``size`` best-ranked target ids (sorted) from the corpus counts (and optional response
    ``records``), keeping ``always`` (default: SmolLM2's chat end token ``<|im_end|>``)."""
    return build_draft_vocab(list(records), size, always=always, response_weight=weights[0],
                             extra_counts=[(counts["stdlib"], weights[1]), (counts["site"], weights[2])])


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
    ap.add_argument("--out", default=None, help="write the id tensor here (torch.save)")
    ap.add_argument("--checkpoint", default=None,
                    help="write it as DIR/draft_vocab.json: the subset of the shared target head a "
                         "drafter checkpoint without its own head drafts over (vLLM ddtree and the reference)")
    args = ap.parse_args(argv)
    if not (args.out or args.checkpoint):
        ap.error("give --out and/or --checkpoint")

    from transformers import AutoTokenizer

    from vllm_ddtree.drafter.io import save_draft_vocab
    from vllm_ddtree.models.target import prepare_target

    corp = corpus_counts(AutoTokenizer.from_pretrained(prepare_target()), args.counts_cache)
    recs = response_records(args.gen, [s for s in args.extra_shards if Path(s).exists()])
    train = [r for r in recs if not is_heldout(r)]
    held = [r for r in recs if is_heldout(r)]
    always: tuple[int, ...] = (2,)
    if args.keep:
        k = torch.load(args.keep, weights_only=False)
        always = tuple((k["draft_vocab"] if isinstance(k, dict) else k).tolist())
    vocab = ranked_vocab(corp, args.size, always, train, (args.w_resp, args.w_stdlib, args.w_site))
    if args.out:
        torch.save(vocab, args.out)
    if args.checkpoint:
        source = (f"vllm_ddtree.train.vocab --size {args.size}: ranked by relative frequency, weights "
                  f"responses {args.w_resp} ({len(train)} responses), stdlib {args.w_stdlib}, "
                  f"site-packages {args.w_site}; no HumanEval text")
        print(f"wrote {save_draft_vocab(args.checkpoint, vocab, source)}")
    info = {"size": len(vocab), "train_responses": len(train), "heldout_responses": len(held),
            "coverage_heldout": coverage(held, vocab), "weights": [args.w_resp, args.w_stdlib, args.w_site],
            "kept": len(always)}
    print(json.dumps(info))


if __name__ == "__main__":
    main()
