"""Which DFlash drafter serves a target when ``{"method": "ddtree"}`` names none.

A drafter reads the target's hidden states and shares its embeddings and LM head, so it fits one
target shape exactly. Targets are matched on their config — architecture, hidden size, layer count,
vocabulary — not on their name, so a local copy or a mirror of a known model is recognised (and so
is a fine-tune of the same shape: it gets the drafter of its base model, which may accept less).

No vLLM import here: the plugin's config patch (P3) and the tests use it directly.
"""

from __future__ import annotations

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
