"""DFlash block-diffusion drafter (PyTorch reference, vLLM-loadable format).

Public API: :class:`DFlashDrafter`, :class:`DrafterConfig`, :class:`DrafterKVCache`,
:class:`DrafterOutput`, :func:`make_block`, :func:`save_drafter`, :func:`load_drafter`,
:func:`target_embeddings`, :func:`load_draft_vocab`, :func:`save_draft_vocab`.
"""

from vllm_ddtree.drafter.io import (
    DRAFT_VOCAB_FILE,
    load_draft_vocab,
    load_drafter,
    save_draft_vocab,
    save_drafter,
    target_embeddings,
)
from vllm_ddtree.drafter.model import (
    MASK_TOKEN_ID,
    DFlashDrafter,
    DrafterConfig,
    DrafterKVCache,
    DrafterOutput,
    make_block,
)

__all__ = [
    "DRAFT_VOCAB_FILE",
    "load_draft_vocab",
    "save_draft_vocab",
    "MASK_TOKEN_ID",
    "DFlashDrafter",
    "DrafterConfig",
    "DrafterKVCache",
    "DrafterOutput",
    "make_block",
    "load_drafter",
    "save_drafter",
    "target_embeddings",
]
