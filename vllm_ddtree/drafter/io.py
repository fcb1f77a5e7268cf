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


def load_drafter(path: str | Path, embed_tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Load a drafter saved by :func:`save_drafter`; ``embed_tokens`` is the target's [V, H] matrix."""
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
    return model.to(dtype)


def target_embeddings(target_dir: str | Path) -> torch.Tensor:
    """The target's input embedding matrix [V, H] (float32) from its safetensors."""
    sd = load_file(str(Path(target_dir) / "model.safetensors"))
    return sd["model.embed_tokens.weight"].float()
