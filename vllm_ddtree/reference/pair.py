"""Load the project's toy model pair: SmolLM2-135M-Instruct (target) and our trained DFlash drafter."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

# The drafter trained by this project is committed in the repository (see its README).
DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-dflash"


def drafter_dir() -> Path:
    """`$VLLM_DDTREE_DRAFTER` or the committed checkpoint."""
    return Path(os.environ.get("VLLM_DDTREE_DRAFTER", DEFAULT_DRAFTER))


@dataclass
class ModelPair:
    """A float32 transformers target, its tokenizer and a DFlash drafter on top of it."""

    target: object
    tokenizer: object
    drafter: object
    target_dir: Path
    drafter_dir: Path

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.target.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def load_pair(drafter: str | Path | None = None, draft_vocab: str = "checkpoint") -> ModelPair:
    """Prepare the target if needed and load both models in float32 (exactness needs float32).

    ``draft_vocab``: ``"checkpoint"`` uses the drafter checkpoint's draft-vocabulary subset if it
    ships one (as the vLLM proposer does), ``"full"`` the whole shared head (see ``load_drafter``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.drafter import load_drafter
    from vllm_ddtree.models.target import prepare_target

    tdir = prepare_target()
    ddir = Path(drafter) if drafter else drafter_dir()
    if not (ddir / "config.json").is_file():
        raise FileNotFoundError(
            f"no DFlash drafter at {ddir}: the trained toy drafter lives in vllm_ddtree/checkpoints/smollm2-dflash "
            "(or set VLLM_DDTREE_DRAFTER)"
        )
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(tdir)
    embed = target.get_input_embeddings().weight.detach()
    draft = load_drafter(ddir, embed, dtype=torch.float32, draft_vocab=draft_vocab).eval()
    return ModelPair(target, tokenizer, draft, tdir, ddir)
