"""Subprocess helper: does a prefix-cache hit hand the drafter the K/V it wrote? (in-process engine)

    python prefix_cache_drafter.py OUT.json VARIANT_JSON [VARIANT_JSON ...]

A variant is {"spec": SPEC, "corrupt": bool, "gate_closed": bool}; each runs one ddtree engine (prefix
caching on, 32-token blocks, one request at a time), one after another in this process (each process
spends seconds importing vLLM), greedy, three passes:

1. long prompts (two HumanEval prompts each) generate 48 tokens;
2. each prompt followed by its answer (a conversation's next turn) generates 24 more: its blocks,
   the answer's included, come from the prefix cache, the target's K/V and the drafter's;
3. the prefix cache is reset and pass 2 runs again: every block computed afresh.

Per drafting step of passes 2 and 3 the drafter's best log-probability at each depth is recorded by
the step's position. What the drafter reads from a cached block must equal what it computes afresh,
so passes 2 and 3 must agree at every position both drafted from.

`corrupt` overwrites every drafter K/V cache with noise after pass 1 (the negative control: the
cached blocks pass 2 reads then hold noise). `gate_closed` makes the speculation gate (spec with
`"min_tree_budget": 0`) find the target alone far faster than any tree and probe every third step,
from the same state for every request: most of the answer's tokens reach the drafter through
undrafted steps' context pass, and passes 2 and 3 draft at the same steps while they accept alike
(a draft depends on which earlier steps drafted, not only on the committed context).

Writes a list, per variant: {"cached": [prompt tokens read from the cache per request, per pass],
"outputs": [per pass], "draft_logp": [pass 2, pass 3: per request {position: [log-probability per
depth]}], "undrafted": steps of pass 1 the gate kept from drafting, "turn_tokens": pass 2's prompt
lengths, "block_size", "block_drop": whether vLLM drops the trailing cached block
(`use_eagle_block_drop()`)}.
"""

import argparse
import json

from generate_spec import collect_and_freeze  # same folder: the script's directory is on sys.path


def run_variant(spec: dict, corrupt: bool, gate_closed: bool) -> dict:
    """One engine's three passes (see above)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.data.humaneval import humaneval_chat_prompts
    from vllm_ddtree.models.target import prepare_target

    llm = LLM(model=str(prepare_target()), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              block_size=32, enable_prefix_caching=True, max_num_seqs=1, speculative_config=spec)
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    tok = llm.get_tokenizer()
    singles = humaneval_chat_prompts(tok, 8)
    prompts = [tok(a + b, add_special_tokens=False)["input_ids"] for a, b in zip(singles[0::2], singles[1::2])]
    gate = drafter.auto.gate if drafter.auto is not None else None

    def run(token_prompts: list[list[int]], max_tokens: int) -> tuple[list, list, list]:
        outs, cached, logps = [], [], []
        for p in token_prompts:
            DRAFT_LOGP.clear()
            if gate_closed:  # the same schedule for every request, pass after pass
                gate._since_probe, gate._interval, gate.advantage = {}, {}, {}
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(temperature=0, max_tokens=max_tokens),
                             use_tqdm=False)[0]
            outs.append(list(o.outputs[0].token_ids))
            cached.append(o.num_cached_tokens or 0)
            logps.append(dict(DRAFT_LOGP))
        return outs, cached, logps

    if gate_closed:
        gate.probe_every = gate.max_probe_every = gate.max_loss_wait = 3
        gate.stale_s = float("inf")
        gate.ar_seconds = {1: [1e-6]}
    undrafted = gate.undrafted if gate is not None else 0
    out1, cached1, _ = run(prompts, 48)
    undrafted = (gate.undrafted if gate is not None else 0) - undrafted
    if corrupt:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        g = torch.Generator().manual_seed(0)
        for name in drafter._draft_attn_layer_names:
            cache = ctx[name].kv_cache  # the layer's whole paged cache (vLLM 0.32: a tensor)
            cache.copy_(torch.randn(cache.shape, generator=g, dtype=cache.dtype))
    turns = [p + o for p, o in zip(prompts, out1)]
    out2, cached2, logp2 = run(turns, 24)
    assert llm.reset_prefix_cache()
    out3, cached3, logp3 = run(turns, 24)
    result = {"cached": [cached1, cached2, cached3], "outputs": [out1, out2, out3], "draft_logp": [logp2, logp3],
              "undrafted": undrafted, "turn_tokens": [len(t) for t in turns],
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
              "block_drop": llm.llm_engine.vllm_config.speculative_config.use_eagle_block_drop()}
    del llm, drafter, gate  # nothing may keep this engine (its KV cache) alive into the next
    collect_and_freeze()
    return result


DRAFT_LOGP: dict[int, list[float]] = {}  # the running request's drafting steps: position -> per-depth best logp

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args()

    from vllm_ddtree.proposer import DDTreeProposer

    tree_drafts = DDTreeProposer._tree_drafts

    def recorded(self, *a, **kw):
        position = int(self.runner.input_batch.num_tokens_no_spec[0])  # one request at a time
        logits = self._draft_head(self._draft_hidden)  # [depths, V]: this step's drafted depths
        DRAFT_LOGP[position] = logits.float().log_softmax(-1).amax(-1).flatten().tolist()
        return tree_drafts(self, *a, **kw)

    DDTreeProposer._tree_drafts = recorded
    results = []
    for arg in args.variants:
        v = json.loads(arg)
        results.append(run_variant(v["spec"], v.get("corrupt", False), v.get("gate_closed", False)))
    with open(args.out, "w") as f:
        json.dump(results, f)
