"""ddtree's own options, as they appear in vLLM's ``--speculative-config``.

A ddtree speculative config is vLLM's usual dict plus the keys below, all top-level::

    {"method": "ddtree", "model": "<dflash drafter dir>",
     "tree_budget": "auto", "min_tree_budget": 0, "max_tree_budget": 64, "prompt_lookup_tokens": 8,
     "ngram_weight": 0.2, "ngram_order": 3, "ngram_corpus": "code.ngram.pt",
     "device_profile": "cpu"}

``{"method": "ddtree"}`` alone is the same as the first three lines with the model from
:mod:`vllm_ddtree.drafters` (on a GPU ``ngram_weight`` is 0, see the field): the defaults are the configuration that measured fastest on the toy pair
(``benchmarks/results/vllm_e2e_defaults.json``), chosen among fixed and automatic budgets with and
without the prompt-lookup branch and the speculation gate.

Two widths are kept apart on purpose (vLLM's ``num_speculative_tokens`` means both for a chain):

* the **drafter width** — how many per-depth marginals the DFlash drafter proposes in one forward,
  ``block_size - 1`` from the drafter's config (15 for the released b16 checkpoints);
* the **verify width** — how many draft-tree nodes the target may verify per request and step,
  the (maximum) tree budget. This is what vLLM's scheduler, KV lookahead and metrics see as
  ``num_speculative_tokens``.

No vLLM import here: the reference decoder, the CLI and tests use this module without vLLM.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

#: Device profiles of the budget cost model (see ``vllm_ddtree.tree.cost.PROFILES``).
DEVICE_PROFILES: tuple[str, ...] = ("cpu", "h100", "h200")

#: ``ngram_weight`` where n-gram rescoring is on by default (a CPU, or an ``ngram_corpus`` given).
DEFAULT_NGRAM_WEIGHT = 0.2

#: Default cap on the tree size when ``tree_budget="auto"`` and no ``max_tree_budget`` is given.
DEFAULT_MAX_TREE_BUDGET = 64

#: Largest ``ngram_order``: each order is one count lookup per draft step, and keys of long contexts
#: already wrap past 63 bits (a corpus table's act as hashes), so longer contexts only add lookups. The
#: online tables' keys must not wrap (a finished request's counts are dropped by their namespace): with
#: n-gram rescoring on, orders whose keys would are refused at start-up against the target's vocabulary.
MAX_NGRAM_ORDER = 16

#: What a speculative config must change when the checkpoint's draft vocabulary meets a head whose rows
#: cannot be gathered (a quantized one).
VOCAB_SUBSET_NEEDS_PLAIN_HEAD = (
    "speculative_config: draft_vocab=\"checkpoint\" needs the drafter's shared LM head unquantized "
    "(plain floating-point rows, vLLM's vocabulary-parallel layout under tensor parallelism); "
    "set \"draft_vocab\": \"full\""
)


def _closest(key: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(key, choices, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


@dataclass(frozen=True)
class DDTreeConfig:
    """Options of the ``ddtree`` speculative method (validated on construction).

    Build it from a user mapping with :meth:`from_mapping`, which also rejects unknown keys.
    All errors are ``ValueError``s that name the key and say what to change.
    """

    tree_budget: int | Literal["auto"] = "auto"
    """Draft-tree nodes verified per request and step (the root is not counted), or ``"auto"``
    to let the budget controller (BASTION cost model) pick it per step between
    ``min_tree_budget`` and ``max_tree_budget``."""

    min_tree_budget: int | None = None
    """Smallest tree the budget controller may choose (``tree_budget="auto"`` only; default 0).
    ``0`` lets it choose no tree at all: while the trees' predicted tokens per second stay below
    the target alone's, measured on undrafted steps, steps decode without drafting (vLLM's K = 0
    path: the drafter only reads the new context), with a drafted probe every few steps
    (``vllm_ddtree.tree.SpeculationGate``)."""

    max_tree_budget: int | None = None
    """Largest tree the budget controller may choose (``tree_budget="auto"`` only; default 64).
    This is the verify width vLLM reserves query rows and KV slots for."""

    ngram_weight: float | None = None
    """Weight λ of the prefix-aligned n-gram score added to the drafter's log-probabilities
    (PRESTO). ``0`` disables n-gram rescoring. ``None`` (default): 0.2 on a CPU or with an
    ``ngram_corpus``, 0 on a GPU, where the engine runs the tree step op by op: the rescoring's
    table lookups (700-1,200 more device ops per step, ``benchmarks/results/step_overhead.json``;
    1,100-2,100 when the GPU runs below were made) took the step's device work from 13.5 to 41.0 ms
    on an H100 (8.4 to 24.5 ms on an H200, ``benchmarks/results/gpu/``), more than the whole Qwen3-8B
    verify forward (11.7 ms), for 11-14% more τ at budget 64 in the exact replays (the drafter's
    model card)."""

    ngram_order: int = 3
    """Order of the n-gram model (3 = two tokens of context). At least 2."""

    ngram_corpus: str | None = None
    """Optional path to a corpus n-gram table (``vllm-ddtree build-ngram``); without it the
    n-gram model is built online from each request's prompt and output only."""

    prompt_lookup_tokens: int = 8
    """Length of a prompt-lookup branch added to every tree: the tokens most often seen after the
    request's last ``ngram_order - 1`` tokens in its own prompt and output, continued greedily (the
    online n-gram counts; code and quotes repeat). Shared with the tree where the drafter proposed
    the same path; verified like every other node, so output stays exact. Adds up to this many
    nodes to the verify width. With a fixed ``tree_budget`` every proposed node is verified; with
    ``"auto"`` the budget buys the path's nodes only where their measured acceptance pays for their
    rows. Default 8; ``0`` disables it."""

    device_profile: str | None = None
    """Hardware profile of the budget cost model: one of ``cpu``, ``h100``, ``h200``.
    ``None`` picks it from the platform vLLM runs on."""

    draft_vocab: str = "checkpoint"
    """Vocabulary the drafter's logits span when it shares the target's LM head. ``"checkpoint"``
    (default): the draft-vocabulary subset the drafter checkpoint ships in
    ``draft_vocab.json`` if it has one, else the whole head; ``"full"``: the whole head.
    The subset only changes which tokens can be drafted (and makes the drafter's head matmul
    smaller); output stays exact."""

    drafter_width: int | None = None
    """Resolved from the drafter checkpoint (``block_size - 1``); not a user option."""

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def user_keys(cls) -> list[str]:
        """The keys a user may put in the speculative config for ddtree."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "drafter_width"]

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> DDTreeConfig:
        """Validate user options (ddtree keys only) and build the config."""
        if not isinstance(options, Mapping):
            raise ValueError(
                f"speculative_config: 'ddtree' must be an object of ddtree options (or leave it out and put them "
                f"top-level), got {options!r}"
            )
        known = cls.user_keys()
        for key in options:
            if key not in known:
                raise ValueError(
                    f"speculative_config: unknown ddtree option {key!r}{_closest(key, known)}; "
                    f"ddtree accepts {', '.join(known)}"
                )
        return cls(**dict(options))

    def __post_init__(self) -> None:
        tb = self.tree_budget
        if isinstance(tb, str):
            if tb != "auto":
                raise ValueError(
                    f"speculative_config: tree_budget={tb!r} is not valid; give a positive integer "
                    "(a fixed tree size) or \"auto\" (the budget controller)"
                )
        elif isinstance(tb, bool) or not isinstance(tb, int):
            raise ValueError(
                f"speculative_config: tree_budget must be a positive integer or \"auto\", got {tb!r}"
            )
        elif tb < 1:
            raise ValueError(f"speculative_config: tree_budget must be >= 1, got {tb}; use 1 or more nodes")
        else:
            for key in ("min_tree_budget", "max_tree_budget"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"speculative_config: {key} only applies with tree_budget=\"auto\"; "
                        f"remove it, or set tree_budget=\"auto\" (tree_budget is fixed at {tb})"
                    )
        for key in ("min_tree_budget", "max_tree_budget", "ngram_order", "prompt_lookup_tokens", "drafter_width"):
            v = getattr(self, key)
            optional = key in ("min_tree_budget", "max_tree_budget", "drafter_width")
            if (v is None and not optional) or (v is not None and (isinstance(v, bool) or not isinstance(v, int))):
                raise ValueError(f"speculative_config: {key} must be an integer, got {v!r}")
        lo, hi = self.min_budget, self.max_budget
        if lo < (0 if self.adaptive else 1):
            raise ValueError(f"speculative_config: min_tree_budget must be >= 0 (0: the controller may skip "
                             f"drafting), got {lo}")
        if hi < 1:
            raise ValueError(f"speculative_config: max_tree_budget must be >= 1, got {hi}")
        if lo > hi:
            raise ValueError(
                f"speculative_config: min_tree_budget ({lo}) is larger than max_tree_budget ({hi}); "
                "lower min_tree_budget or raise max_tree_budget"
            )
        w = self.ngram_weight
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0):
            raise ValueError(
                f"speculative_config: ngram_weight must be a number >= 0 and finite (0 disables n-gram rescoring), "
                f"got {w!r}"
            )
        if not 2 <= self.ngram_order <= MAX_NGRAM_ORDER:
            raise ValueError(
                f"speculative_config: ngram_order must be >= 2 (one token of context) and <= {MAX_NGRAM_ORDER}, "
                f"got {self.ngram_order}"
            )
        if self.prompt_lookup_tokens < 0:
            raise ValueError(
                f"speculative_config: prompt_lookup_tokens must be >= 0 (0 disables the prompt-lookup branch), "
                f"got {self.prompt_lookup_tokens}"
            )
        if self.ngram_corpus is not None:
            if not isinstance(self.ngram_corpus, str) or not self.ngram_corpus:
                raise ValueError(
                    f"speculative_config: ngram_corpus must be the path of an n-gram table (a non-empty string), "
                    f"got {self.ngram_corpus!r}"
                )
            path = Path(self.ngram_corpus).expanduser().resolve()  # workers may not share the cwd
            if not path.is_file():
                raise ValueError(
                    f"speculative_config: ngram_corpus file {str(path)!r} does not exist; build one with "
                    "`vllm-ddtree build-ngram` or remove ngram_corpus to use the online n-gram model only"
                )
            if self.ngram_weight == 0:  # the corpus only feeds the rescoring; the lookup branch reads online counts
                raise ValueError(
                    "speculative_config: ngram_corpus is only read by n-gram rescoring, which ngram_weight=0 turns "
                    "off; remove ngram_corpus or set ngram_weight > 0"
                )
            order = int(corpus_metadata(path)["order"])
            if order < self.ngram_order:
                raise ValueError(
                    f"speculative_config: ngram_corpus {str(path)!r} holds n-grams up to order {order}, fewer than "
                    f"ngram_order={self.ngram_order}; set ngram_order <= {order} or rebuild the table with "
                    f"`vllm-ddtree build-ngram --order {self.ngram_order}`"
                )
            object.__setattr__(self, "ngram_corpus", str(path))
        if self.draft_vocab not in ("checkpoint", "full"):
            raise ValueError(
                f"speculative_config: draft_vocab={self.draft_vocab!r} is not valid; use \"checkpoint\" "
                "(the drafter checkpoint's draft_vocab.json, if any) or \"full\" (the whole target vocabulary)"
            )
        if self.device_profile is not None and self.device_profile not in DEVICE_PROFILES:
            raise ValueError(
                f"speculative_config: device_profile={self.device_profile!r} is unknown; "
                f"choose one of {', '.join(DEVICE_PROFILES)} (or leave it out to detect it)"
            )
        if self.drafter_width is not None and self.drafter_width < 1:
            raise ValueError(
                f"ddtree drafter width (block_size - 1) must be >= 1, got {self.drafter_width}; "
                "the drafter's config.json needs block_size >= 2"
            )

    # ---- checks against the engine ----------------------------------------------------------

    def check_target(self, *, max_model_len: int, vocab_size: int, drafter: str = "") -> None:
        """Refuse what cannot fit the target: a verify width or a drafter block the context window
        cannot hold, an n-gram corpus built for another vocabulary. ``ValueError`` naming the key
        (and ``drafter``, the drafter's name or path, where the drafter is at fault)."""
        width = self.verify_width
        if width + 2 > max_model_len:  # one context token, the root, then the tree's nodes
            budget = "tree_budget" if not self.adaptive else "max_tree_budget"
            raise ValueError(
                f"speculative_config: the verify width {budget} + prompt_lookup_tokens = {width} does not fit the "
                f"target's max_model_len {max_model_len} (each step writes the root and every tree node after the "
                f"context); lower {budget} or prompt_lookup_tokens to at most {max_model_len - 2} in total"
            )
        if self.drafter_width is not None and self.drafter_width + 2 > max_model_len:
            name = f" {drafter!r}" if drafter else ""
            raise ValueError(
                f"speculative_config: the drafter{name} has block_size {self.drafter_width + 1}, which does not fit "
                f"the target's max_model_len {max_model_len} (the drafter writes its whole block after the context, "
                "so it would never draft); raise max_model_len or use a drafter with a smaller block_size"
            )
        if self.ngram_corpus is not None:
            vocab = int(corpus_metadata(Path(self.ngram_corpus))["vocab_size"])
            if vocab != vocab_size:
                raise ValueError(
                    f"speculative_config: ngram_corpus {self.ngram_corpus!r} was built for a vocabulary of {vocab} "
                    f"tokens, the target has {vocab_size}; rebuild it with `vllm-ddtree build-ngram --tokenizer "
                    "TARGET` or remove ngram_corpus"
                )

    def check_parallelism(self, *, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
                          draft_tensor_parallel_size: int | None = None, microbatches: int = 1) -> None:
        """Refuse, at configuration time, the parallel layouts ddtree cannot run (``ValueError`` naming
        the key).

        The DFlash drafter runs inside the target's workers, in the target's tensor-parallel group (it
        reads the target's hidden states and shares its embeddings and LM head), so a drafter
        tensor-parallel size other than the target's cannot be honoured. Microbatching (vLLM's dual
        batch overlap) splits a step's attention metadata by token ranges, which the step's tree
        masks, positions and sampling rows are not split with.
        """
        if pipeline_parallel_size > 1:
            raise ValueError(
                "method 'ddtree' does not support pipeline parallelism yet (the tree proposer reads the "
                "target's hidden states on the last rank only); set pipeline_parallel_size=1"
            )
        if microbatches > 1:
            raise ValueError(
                f"method 'ddtree' does not support microbatching ({microbatches} microbatches): a step's tree masks "
                "and rows are built for the whole batch, not for token ranges of it; turn off --enable-dbo and "
                "leave --ubatch-size unset"
            )
        if draft_tensor_parallel_size is not None and draft_tensor_parallel_size != tensor_parallel_size:
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size={draft_tensor_parallel_size} is not supported with "
                f"method 'ddtree' on a target with tensor_parallel_size={tensor_parallel_size}: the DFlash drafter "
                "runs in the target's tensor-parallel group (it reads the target's hidden states and shares its "
                f"embeddings and LM head); remove draft_tensor_parallel_size or set it to {tensor_parallel_size}"
            )

    # ---- derived ----------------------------------------------------------------------------

    @property
    def adaptive(self) -> bool:
        """True when the budget controller picks the tree size per step."""
        return self.tree_budget == "auto"

    @property
    def min_budget(self) -> int:
        """Smallest tree size used (equals the fixed budget when not adaptive; 0: no tree allowed)."""
        if not self.adaptive:
            return int(self.tree_budget)
        return 0 if self.min_tree_budget is None else self.min_tree_budget

    @property
    def max_budget(self) -> int:
        """Largest tree size used: the verify width (``num_speculative_tokens`` in vLLM)."""
        if not self.adaptive:
            return int(self.tree_budget)
        return DEFAULT_MAX_TREE_BUDGET if self.max_tree_budget is None else self.max_tree_budget

    @property
    def verify_width(self) -> int:
        """Draft nodes per request the target verifies at most in one step: the largest tree plus
        the prompt-lookup branch (vLLM's ``num_speculative_tokens``)."""
        return self.max_budget + self.prompt_lookup_tokens

    @property
    def max_depth(self) -> int:
        """Deepest node a tree can have, so the most draft tokens one step can accept: a drafter
        node sits at most at the drafter width and the tree's size, a lookup node at most at
        ``prompt_lookup_tokens``. The verify width while the drafter width is unresolved."""
        if self.drafter_width is None:
            return self.verify_width
        return max(min(self.max_budget, self.drafter_width), self.prompt_lookup_tokens)

    @property
    def ngram_enabled(self) -> bool:
        """Whether n-gram rescoring runs (``ngram_weight`` resolved; see `with_platform_defaults`)."""
        return (self.ngram_weight or 0) > 0

    def with_drafter(self, block_size: int) -> DDTreeConfig:
        """A copy with ``drafter_width`` resolved from the drafter's ``block_size``."""
        return dataclasses.replace(self, drafter_width=int(block_size) - 1)

    def with_device_profile(self, name: str) -> DDTreeConfig:
        """A copy with the cost-model profile filled in (when the user gave none)."""
        return self if self.device_profile is not None else dataclasses.replace(self, device_profile=name)

    def with_platform_defaults(self, cpu: bool) -> DDTreeConfig:
        """A copy with what depends on the platform filled in where the user gave nothing: the
        cost-model profile, and ``ngram_weight`` (0.2 on a CPU or with a corpus, else 0)."""
        out = self.with_device_profile("cpu" if cpu else "h100")
        if out.ngram_weight is None:
            out = dataclasses.replace(out, ngram_weight=DEFAULT_NGRAM_WEIGHT if cpu or out.ngram_corpus else 0.0)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (for logs and the config hash)."""
        return dataclasses.asdict(self)


def corpus_metadata(path: Path) -> dict[str, str]:
    """The ``order`` and ``vocab_size`` an n-gram table (``vllm-ddtree build-ngram``) was written with,
    read from its safetensors header alone, so a wrong file fails at configuration time."""
    not_table = (f"speculative_config: ngram_corpus {str(path)!r} is not an n-gram table written by "
                 "`vllm-ddtree build-ngram`")
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:  # safetensors caps its JSON header at 100 MB
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
        meta = header.get("__metadata__") or {}
        int(meta["order"]), int(meta["vocab_size"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{not_table} ({type(e).__name__}: {e})") from None
    return meta
