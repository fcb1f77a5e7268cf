"""Save/load the drafter in the released DFlash format that vLLM's loader reads.

Directory layout:

* ``config.json`` — a Qwen3 config plus ``architectures: ["DFlashDraftModel"]``, ``block_size``,
  ``num_target_layers``, ``draft_vocab_size`` and ``dflash_config: {mask_token_id,
  target_layer_ids}``. ``vocab_size`` is the *target's* vocabulary (vLLM scatters draft logits
  into it with ``d2t``).
* ``model.safetensors`` — drafter weights under vLLM's names (no ``embed_tokens``: the
  target's embeddings are shared; ``lm_head.weight`` has ``draft_vocab_size`` rows; ``d2t``).
  A full-vocabulary head that *is* the target's tied embedding matrix is not stored either: with no
  ``lm_head`` in the checkpoint vLLM shares the target's LM head (``_maybe_share_lm_head``), as the
  reference DFlash drafters do, and :func:`load_drafter` takes the rows from ``embed_tokens``.
* ``mask_embedding.pt`` — ``{"mask_token_id": int, "embedding": Tensor[H]}``, the learned mask
  vector that vLLM substitutes for ``embed_tokens[mask_token_id]``.
* ``draft_vocab.json`` (optional, ours; vLLM's loader ignores it) — ``{"ids": [...]}``, sorted
  target ids: the rows of the *shared* target head the drafter's logits are computed over. A shared
  head spans the whole target vocabulary, and on a CPU that matmul is memory-bound (49152 × 576 fp32
  rows read for every drafted depth); a subset covering the target's outputs keeps the checkpoint
  small (no head stored) and the drafter's head cheap. Drafts only: outputs stay exact either way.
  JSON, not safetensors, because vLLM's loader reads every ``*.safetensors`` file of the drafter's
  directory as weights and refuses unknown names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_ddtree.drafter.model import DFlashDrafter, DrafterConfig


def config_dict(cfg: DrafterConfig, dtype: str = "float32") -> dict:
    """The HF/vLLM ``config.json`` for ``cfg``."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "torch_dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


def config_from_dict(d: dict) -> DrafterConfig:
    """Inverse of :func:`config_dict`."""
    return DrafterConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        head_dim=d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
        rms_norm_eps=d["rms_norm_eps"],
        rope_theta=d.get("rope_parameters", {}).get("rope_theta", d.get("rope_theta", 1e6)),
        max_position_embeddings=d["max_position_embeddings"],
        vocab_size=d["vocab_size"],
        draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
        block_size=d["block_size"],
        target_layer_ids=list(d["dflash_config"]["target_layer_ids"]),
        num_target_layers=d["num_target_layers"],
        mask_token_id=d["dflash_config"]["mask_token_id"],
    )


def save_drafter(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``model`` to ``out_dir`` (weights cast to ``dtype``; ``d2t`` stays int64)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    full = model.cfg.draft_vocab_size == model.cfg.vocab_size
    for name, t in model.state_dict().items():
        if name == "mask_embedding":
            continue
        if name == "lm_head.weight" and full and torch.equal(t, model.embed_tokens.to(t.dtype)):
            continue  # the target's own (tied) head: vLLM shares it when the checkpoint has none
        if name == "d2t" and model.cfg.draft_vocab_size == model.cfg.vocab_size:
            continue  # full vocabulary: vLLM's loader has no d2t parameter to receive it
        sd[name] = t.detach().contiguous() if name == "d2t" else t.detach().to(dtype).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config_dict(model.cfg, dtype_name), indent=2) + "\n")
    torch.save({"mask_token_id": model.cfg.mask_token_id,
                "embedding": model.mask_embedding.detach().to(dtype).clone()}, out / "mask_embedding.pt")
    return out


def load_drafter(path: str | Path, embed_tokens: torch.Tensor, dtype: torch.dtype = torch.float32,
                 draft_vocab: str = "checkpoint") -> DFlashDrafter:
    """Load a drafter saved by :func:`save_drafter`; ``embed_tokens`` is the target's [V, H] matrix.

    ``draft_vocab="checkpoint"`` narrows a shared full head to the checkpoint's
    ``draft_vocab.json`` when it has one (:meth:`DFlashDrafter.narrow_vocab`, as the vLLM
    proposer does); ``"full"`` keeps every row.
    """
    if draft_vocab not in ("checkpoint", "full"):
        raise ValueError(f"draft_vocab must be 'checkpoint' or 'full', got {draft_vocab!r}")
    path = Path(path)
    cfg = config_from_dict(json.loads((path / "config.json").read_text()))
    model = DFlashDrafter(cfg, embed_tokens.to(dtype))
    sd = {k: (v if k == "d2t" else v.to(dtype)) for k, v in load_file(str(path / "model.safetensors")).items()}
    sd.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # full vocabulary: identity
    if "lm_head.weight" not in sd and cfg.draft_vocab_size == cfg.vocab_size:
        sd["lm_head.weight"] = embed_tokens.to(dtype)  # shared target head (see module docstring)
    mask_file = path / "mask_embedding.pt"
    if mask_file.exists():
        m = torch.load(mask_file, weights_only=True)
        sd["mask_embedding"] = (m["embedding"] if isinstance(m, dict) else m).reshape(-1).to(dtype)
    else:
        sd["mask_embedding"] = embed_tokens[cfg.mask_token_id].to(dtype)
    model.load_state_dict(sd, strict=True)
    ids = load_draft_vocab(path, cfg.vocab_size) if draft_vocab == "checkpoint" else None
    if ids is not None:
        model = model.narrow_vocab(ids)
    return model.to(dtype)


DRAFT_VOCAB_FILE = "draft_vocab.json"


def save_draft_vocab(out_dir: str | Path, ids: torch.Tensor, source: str = "") -> Path:
    """Write the draft-vocabulary subset ``ids`` (target ids) next to a shared-head checkpoint;
    ``source`` says how it was chosen (kept in the file for readers)."""
    ids = torch.as_tensor(ids, dtype=torch.long).unique()  # sorted, no duplicates
    path = Path(out_dir) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps({"size": len(ids), "source": source, "ids": ids.tolist()}) + "\n")
    return path


def load_draft_vocab(path: str | Path, vocab_size: int | None = None) -> torch.Tensor | None:
    """The checkpoint's draft-vocabulary subset (sorted target ids [N]), or None if it has none.

    Raises ``ValueError`` naming the file when it is malformed or has ids outside ``[0, vocab_size)``.
    """
    f = Path(path) / DRAFT_VOCAB_FILE
    if not f.is_file():
        return None
    try:
        raw = json.loads(f.read_text()).get("ids")
        ids = torch.tensor(raw)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{f}: expected a JSON object with a list 'ids' of target token ids ({e})") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{f}: expected a JSON object with a non-empty list 'ids' of integer target token ids")
    ids = ids.long()
    if not torch.equal(ids, ids.unique()):
        raise ValueError(f"{f}: 'ids' must be sorted and free of duplicates (save it with save_draft_vocab)")
    if vocab_size is not None and (int(ids[0]) < 0 or int(ids[-1]) >= vocab_size):
        raise ValueError(f"{f}: ids must lie in [0, {vocab_size}) (the target's vocabulary), "
                         f"got [{int(ids[0])}, {int(ids[-1])}]")
    return ids


def target_embeddings(target_dir: str | Path) -> torch.Tensor:
    """The target's input embedding matrix [V, H] (float32) from its safetensors."""
    sd = load_file(str(Path(target_dir) / "model.safetensors"))
    return sd["model.embed_tokens.weight"].float()
