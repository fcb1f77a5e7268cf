"""Which DFlash drafter serves a target when ``{"method": "ddtree"}`` names none.

A drafter reads the target's hidden states and shares its embeddings and LM head, so it fits one
target shape exactly. Targets are matched on their config — architecture, hidden size, layer count,
vocabulary — not on their name, so a local copy or a mirror of a known model is recognised (and so
is a fine-tune of the same shape: it gets the drafter of its base model, which may accept less).

No vLLM import here: the plugin's config patch (P3) and the tests use it directly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The drafter shipped inside the package for the toy target (see its model card, README.md there).
TOY_DRAFTER = Path(__file__).resolve().parent / "checkpoints" / "smollm2-dflash"


@dataclass(frozen=True)
class KnownDrafter:
    """A published DFlash drafter and the target shape it was trained for."""

    target: str  # the target it was trained for, as named on the model hub
    drafter: str  # hub id, or a path inside this package
    architecture: str  # the target's config.json "architectures"[0]
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int

    def fits(self, shape: tuple[str, int, int, int]) -> bool:
        return shape == (self.architecture, self.hidden_size, self.num_hidden_layers, self.vocab_size)


#: z-lab's released DFlash drafters (block size 16) and the toy pair's drafter. Shapes are the
#: targets' config.json values.
DRAFTERS: tuple[KnownDrafter, ...] = (
    KnownDrafter("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "Qwen3ForCausalLM", 2560, 36, 151936),
    KnownDrafter("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "Qwen3ForCausalLM", 4096, 36, 151936),
    KnownDrafter("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", "Qwen3MoeForCausalLM",
                 2048, 48, 151936),
    KnownDrafter("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
                 "LlamaForCausalLM", 4096, 32, 128256),
    KnownDrafter("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "GptOssForCausalLM", 2880, 24, 201088),
    KnownDrafter("HuggingFaceTB/SmolLM2-135M-Instruct", str(TOY_DRAFTER), "LlamaForCausalLM", 576, 30, 49152),
)


def target_shape(hf_config: Any) -> tuple[str, int, int, int]:
    """(architecture, hidden size, layers, vocabulary) of a target's HF config (object or dict)."""
    get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
    archs = get("architectures") or [""]
    return (str(archs[0]), int(get("hidden_size", 0) or 0), int(get("num_hidden_layers", 0) or 0),
            int(get("vocab_size", 0) or 0))


def find_drafter(hf_config: Any) -> KnownDrafter | None:
    """The known drafter whose target has this config's shape, or None."""
    shape = target_shape(hf_config)
    return next((d for d in DRAFTERS if d.fits(shape)), None)


def drafter_table() -> str:
    """The table as text, one line a target, for error messages and docs."""
    return "\n".join(
        f"  {d.target:<38} {d.architecture}, hidden {d.hidden_size}, {d.num_hidden_layers} layers, "
        f"vocab {d.vocab_size} -> {'the toy drafter shipped in vllm_ddtree' if d.drafter == str(TOY_DRAFTER) else d.drafter}"
        for d in DRAFTERS
    )


def no_drafter_error(target: str, hf_config: Any) -> ValueError:
    """The error for a target without a known drafter: what it is, and what to do."""
    arch, hidden, layers, vocab = target_shape(hf_config)
    return ValueError(
        f"speculative_config: method 'ddtree' needs a DFlash drafter, and none is known for the target {target!r} "
        f"({arch}, hidden {hidden}, {layers} layers, vocab {vocab}). Set \"model\" to a DFlash drafter trained for "
        f"this target (a hub id or a directory whose config.json declares DFlashDraftModel). Known targets, matched "
        f"on these four values:\n{drafter_table()}"
    )


def not_dflash_error(model: str, archs: Any) -> ValueError:
    """The error for a ``model`` that is no DFlash drafter (an EAGLE head, the target itself, ...)."""
    return ValueError(
        f"drafter {model!r} is not a DFlash drafter (need architectures DFlashDraftModel, block_size and "
        f"dflash_config in config.json; got architectures {archs}); method 'ddtree' builds on DFlash: set "
        "speculative_config \"model\" to a DFlash drafter trained for the target, or leave it out to use the "
        "drafter table"
    )


#: Integer fields of a drafter's config.json that ddtree checks against the target (vLLM reads the rest).
_INT_FIELDS = ("block_size", "hidden_size", "num_hidden_layers", "vocab_size", "draft_vocab_size")


def check_local_drafter(model: str) -> None:
    """Refuse a local ``model`` that cannot be a DFlash drafter before vLLM builds its config.

    A path that does not exist, a directory without a readable ``config.json``, and a config that is
    not DFlash's (an EAGLE head, a plain causal LM such as the target itself, ``block_size`` that is no
    integer >= 2) each get a ``ValueError`` naming ``model`` and what to change; without this, vLLM's
    DFlash branch would rename e.g. ``LlamaForCausalLM`` to ``DFlashLlamaForCausalLM`` and fail with a
    list of every architecture it supports. Hub ids are left to vLLM (and checked after loading).
    """
    path = Path(model).expanduser()
    looks_local = model.startswith(("/", "./", "../", "~")) or path.exists()
    if not looks_local:
        return
    if not path.exists():
        raise ValueError(f"speculative_config: model {model!r} does not exist; give a DFlash drafter directory "
                         "or hub id, or leave \"model\" out to use the drafter table")
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.is_file():
        raise ValueError(f"speculative_config: model {model!r} is not a directory with a config.json; give the "
                         "DFlash drafter's directory (config.json declaring DFlashDraftModel) or its hub id")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"speculative_config: model {model!r}: {cfg_file} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"speculative_config: model {model!r}: {cfg_file} must hold a JSON object, "
                         f"got {type(cfg).__name__}")
    archs = cfg.get("architectures")
    if (not isinstance(archs, list) or not any(isinstance(a, str) and "DFlash" in a for a in archs)
            or not isinstance(cfg.get("dflash_config"), dict) or "block_size" not in cfg):
        raise not_dflash_error(model, archs)
    for key in _INT_FIELDS:
        v = cfg.get(key)
        if key in cfg and (v is not None or key == "block_size") and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"drafter {model!r}: {key} in config.json must be an integer, got {v!r}")
    if cfg["block_size"] < 2:
        raise ValueError(f"drafter {model!r}: block_size must be >= 2 (one root + at least one mask slot), "
                         f"got {cfg['block_size']}")
    vocab, draft_vocab = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    if draft_vocab is not None and not 1 <= draft_vocab <= (vocab if isinstance(vocab, int) else draft_vocab):
        raise ValueError(f"drafter {model!r}: draft_vocab_size {draft_vocab} in config.json must be in [1, {vocab}] "
                         "(vocab_size)")
    layers, mask = cfg["dflash_config"].get("target_layer_ids"), cfg["dflash_config"].get("mask_token_id")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in layers):
        raise ValueError(f"drafter {model!r}: dflash_config.target_layer_ids in config.json must be a non-empty "
                         f"list of target layer indices, got {layers!r}")
    if "mask_token_id" in cfg["dflash_config"] and (isinstance(mask, bool) or not isinstance(mask, int)):
        raise ValueError(f"drafter {model!r}: dflash_config.mask_token_id in config.json must be a token id, "
                         f"got {mask!r}")
