"""Subprocess helper: vLLM with vllm-ddtree installed, reporting a vLLM version the plugin was not run with.

    python untested_vllm.py OUT.json {changed|unchanged|failing} DRAFTER

``changed``: the plugin's reference fingerprint of one patch target (P3, SpeculativeConfig.__post_init__)
is altered, so the installed sources read as a release that changed that code. ``unchanged``: the
sources are 0.32.0's, only the version string is new. ``failing``: the version is 0.32.0 but the
last patch (P10-P13, the model runner) raises, after the earlier ones were applied. Engine and worker run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the faked version is what the plugin sees when vLLM loads it.
Writes what happened: the plugin's log lines, whether vLLM was patched, greedy token ids without
speculation, and (``unchanged``) whether a ddtree config builds.
"""

import json
import logging
import sys

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    import vllm

    from vllm_ddtree import compat, vllm_patches

    if mode == "failing":
        def broken():
            raise RuntimeError("model runner patch failed")

        vllm_patches._patch_model_runner = broken
    else:
        vllm.__version__ = "0.99.0"

    real = compat.load_reference
    if mode == "changed":
        def altered():
            prints = real()
            prints["config/speculative.py::SpeculativeConfig.__post_init__"]["sha"] = "0" * 16
            return prints

        compat.load_reference = altered

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("vllm.ddtree").addHandler(Keep())
    from vllm import LLM, SamplingParams
    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.vllm import VllmConfig

    from vllm_ddtree.models.target import prepare_target

    llm = LLM(model=str(prepare_target()), dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
    ids = [o.outputs[0].token_ids for o in llm.generate(["def add(a, b):", "The capital of France is"],
                                                        SamplingParams(temperature=0, max_tokens=12))]
    patched = "ddtree" in SpeculativeConfig.__dataclass_fields__
    # Every patched attribute is vLLM's own again where nothing was patched.
    def ours(value) -> bool:
        func = getattr(value, "fget", value)  # a property's getter
        code = getattr(func, "__code__", None)  # functools.wraps copies the name and module, not the code
        return code is not None and "vllm_ddtree" in code.co_filename

    leftovers = [name for owner, name in ((SpeculativeConfig, "__init__"), (SpeculativeConfig, "__post_init__"),
                                           (SpeculativeConfig, "use_dflash"), (SpeculativeConfig, "compute_hash"),
                                           (VllmConfig, "num_lookahead_tokens"))
                 if ours(owner.__dict__.get(name))]
    ddtree_config = None
    if patched:
        from vllm.engine.arg_utils import EngineArgs

        drafter = sys.argv[3]
        cfg = EngineArgs(model=str(prepare_target()), dtype="float32", max_model_len=512,
                         speculative_config={"method": "ddtree", "model": drafter}).create_engine_config()
        ddtree_config = cfg.speculative_config.method
    with open(out, "w") as f:
        json.dump({"log": lines, "patched": patched, "leftovers": leftovers, "token_ids": [list(i) for i in ids],
                   "ddtree_config": ddtree_config}, f)
