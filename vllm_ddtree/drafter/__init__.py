"""DFlash block-diffusion drafter (PyTorch reference, vLLM-loadable format).

Public API: :class:`DFlashDrafter`, :class:`DrafterConfig`, :class:`DrafterKVCache`,
:class:`DrafterOutput`, :func:`make_block`, :func:`save_drafter`, :func:`load_drafter`,
:func:`target_embeddings`.
"""

from vllm_ddtree.drafter.io import load_drafter, save_drafter, target_embeddings
from vllm_ddtree.drafter.model import (
    MASK_TOKEN_ID,
    DFlashDrafter,
    DrafterConfig,
    DrafterKVCache,
    DrafterOutput,
    make_block,
)

__all__ = [
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
