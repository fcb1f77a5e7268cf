"""DFlash block-diffusion drafter in plain PyTorch, weight-compatible with vLLM's DFlash loader.

Architecture (docs/design.md §8; format contract = vLLM 0.32 ``qwen3_dflash.py``):

* Context: the target's hidden states after layers ``target_layer_ids`` (transformers'
  ``hidden_states[id + 1]``), concatenated, ``fc`` (no bias) → ``hidden_norm`` (RMSNorm).
  In every drafter layer the context is projected to K/V by that layer's ``k_proj``/``v_proj``
  (then ``k_norm`` and RoPE at the context's absolute positions); it never passes through
  ``input_layernorm`` or the MLPs. This is exactly what vLLM's
  ``precompute_and_store_context_kv`` writes into the drafter's paged cache.
* Block: ``[root token, MASK × (block_size − 1)]`` at positions ``p .. p + block_size − 1`` where
  the root sits at ``p`` and the context is every position ``< p``. Queries come from the block
  only; each block query attends to all context keys and, bidirectionally, to all block keys.
* Qwen3 decoder layers (q/k per-head RMSNorm, SwiGLU MLP), final ``norm``, then the LM head.
  Embeddings are the target's (not stored). The LM head is a reduced *draft vocabulary*
  (``draft_vocab_size`` rows) with the EAGLE-3 style offset map ``d2t``
  (``target_id = draft_id + d2t[draft_id]``), which vLLM's loader accepts.

Mask token. SmolLM2's vocabulary (49152) equals its embedding table: no spare row. We use a
token the instruct target never produces, ``<empty_output>`` (id 16, a pre-training special
token), as ``mask_token_id`` and learn a separate mask embedding that is shipped as
``mask_embedding.pt`` — vLLM's DFlash loader substitutes that file's vector for
``embed_tokens[mask_token_id]`` (``DFlashQwen3ForCausalLM._read_mask_embedding``), so neither
the target's nor the drafter's embedding table changes. Should the target ever emit id 16 as a
root token, the drafter sees the mask vector there: drafts get worse, output stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

MASK_TOKEN_ID = 16  # <empty_output> in SmolLM2's tokenizer; never produced by the instruct model


@dataclass
class DrafterConfig:
    """Hyper-parameters of a DFlash drafter (the subset of a Qwen3 config we use)."""

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 1
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152  # the target's vocabulary
    draft_vocab_size: int = 49152
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 8, 14, 20, 27])
    num_target_layers: int = 30
    mask_token_id: int = MASK_TOKEN_ID

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)


class RMSNorm(nn.Module):
    """RMSNorm as in Qwen3/Llama (float32 statistics)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``positions.shape + (head_dim,)`` (neox / rotate-half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    ang = positions.float()[..., None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, hd] with cos/sin [B, T, hd]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context K/V ; block K/V], queries from the block."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.cfg.head_dim).transpose(1, 2)  # [B, n, T, hd]

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, RoPE'd) and V of ``x`` [B, T, H] → two [B, kv_heads, T, hd] tensors."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.cfg.num_key_value_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.cfg.num_key_value_heads)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x`` [B, Q, H] block hidden states; ``ctx_k/v`` [B, kvh, C, hd]; ``mask`` bool
        [B, Q, C + Q] (True = may attend) or None (attend to everything)."""
        cfg = self.cfg
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), cfg.num_attention_heads)), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_k, k], 2)
        v = torch.cat([ctx_v, v], 2)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
        B, _, Q, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, -1))


class MLP(nn.Module):
    """SwiGLU MLP (Qwen3/Llama)."""

    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer with DFlash KV injection."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):  # noqa: D401 - same contract as DFlashAttention
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DrafterOutput:
    """Result of one drafter forward over blocks."""

    hidden: torch.Tensor  # [B, Q, H] after the final norm
    logits: torch.Tensor  # [B, Q, draft_vocab_size] (draft-vocabulary order; see to_target_logits)


class DFlashDrafter(nn.Module):
    """DFlash drafter. Holds references to the target's (frozen) embedding matrix.

    Parameters saved in the vLLM format: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``layers.{i}.{input,post_attention}_layernorm.weight``, ``fc.weight``, ``hidden_norm.weight``,
    ``norm.weight``, ``lm_head.weight`` and ``d2t`` (see :mod:`vllm_ddtree.drafter.io`).
    """

    def __init__(self, cfg: DrafterConfig, embed_tokens: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)  # [V, H], frozen
        self.mask_embedding = nn.Parameter(embed_tokens[cfg.mask_token_id].detach().clone())
        self.fc = nn.Linear(cfg.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # d2t[i] = target_id(i) - i (EAGLE-3 convention used by vLLM's loader).
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    # ---- pieces -------------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft-vocabulary row."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target embeddings, with the learned mask vector at ``mask_token_id``."""
        e = F.embedding(token_ids, self.embed_tokens)
        is_mask = (token_ids == self.cfg.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(e.dtype), e)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [B, C, F, H] or [B, C, F·H] → fused context [B, C, H] (fc + hidden_norm)."""
        if features.dim() == 4:
            features = features.flatten(-2)
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V ([B, kvh, C, hd] each) of fused context states at ``positions`` [B, C]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return [layer.self_attn.project_kv(fused, cos, sin) for layer in self.layers]

    def narrow_vocab(self, ids: torch.Tensor) -> "DFlashDrafter":
        """This drafter with its LM head cut to the target ids ``ids`` (sorted [N], each already in
        the draft vocabulary): the same logits on those ids, none elsewhere; ``d2t`` maps the rows
        back. Drafts can only propose those ids; verification keeps the output exact regardless."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.d2t.device)
        row_of = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=ids.device)
        row_of[self.draft_to_target] = torch.arange(self.cfg.draft_vocab_size, device=ids.device)
        rows = row_of[ids]
        if bool((rows < 0).any()):
            missing = ids[rows < 0][:5].tolist()
            raise ValueError(f"narrow_vocab: target ids {missing} are not in this drafter's vocabulary")
        cfg = replace(self.cfg, draft_vocab_size=len(ids))
        out = DFlashDrafter(cfg, self.embed_tokens)
        sd = self.state_dict()
        sd["lm_head.weight"] = sd["lm_head.weight"][rows].clone()
        sd["d2t"] = ids - torch.arange(len(ids), device=ids.device)
        out.load_state_dict(sd)
        return out.to(self.lm_head.weight.dtype)

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits into the target vocabulary (−inf elsewhere), as vLLM does."""
        out = draft_logits.new_full(draft_logits.shape[:-1] + (self.cfg.vocab_size,), float("-inf"))
        out[..., self.draft_to_target] = draft_logits
        return out

    def run_blocks(
        self,
        block_token_ids: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
        compute_logits: bool = True,
        logit_positions: int | None = None,
    ) -> DrafterOutput:
        """Run block queries [B, Q] at ``block_positions`` [B, Q] against per-layer context K/V.

        ``mask`` bool [B, Q, C + Q]: which context and block keys each query may see (None = all).
        ``logit_positions``: LM head on the first n block positions only (the block attention still
        spans all Q; a tree of B nodes needs at most 1 + B).
        """
        x = self.embed(block_token_ids)
        cos, sin = rope_cos_sin(block_positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, mask)
        hidden = self.norm(x)
        logits = self.lm_head(hidden[:, :logit_positions]) if compute_logits else hidden.new_zeros(0)
        return DrafterOutput(hidden=hidden, logits=logits)

    # ---- the API the reference decoder calls ----------------------------------------------
    def forward(
        self,
        block_token_ids: torch.Tensor,
        block_positions: torch.Tensor,
        context_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        cache: "DrafterKVCache | None" = None,
        context_mask: torch.Tensor | None = None,
        logit_positions: int | None = None,
    ) -> DrafterOutput:
        """Draft one block per row.

        Args:
            block_token_ids: [B, bs] — ``[root, MASK × (bs−1)]`` (use ``make_block``).
            block_positions: [B, bs] — absolute positions ``p .. p+bs−1`` (root at ``p``).
            context_features: [B, C, F, H] or [B, C, F·H] target features of *new* context tokens
                (those not yet in ``cache``); appended to ``cache`` if one is given.
            context_positions: [B, C] positions of those tokens (required with features).
            cache: committed context K/V (see :class:`DrafterKVCache`); may be None when all
                context comes in ``context_features``.
            context_mask: optional bool [B, C_total] marking valid context columns (padding).
            logit_positions: compute logits for the first n block positions only (default all).

        Returns: :class:`DrafterOutput` with logits over the draft vocabulary; use
        :meth:`to_target_logits` for target-vocabulary logits.
        """
        if context_features is not None:
            assert context_positions is not None, "context_positions are required with context_features"
            new_kv = self.context_kv(self.fuse_features(context_features), context_positions)
            if cache is not None:
                cache.append(new_kv)
                kv = cache.layers
            else:
                kv = new_kv
        else:
            assert cache is not None, "need context_features or a cache"
            kv = cache.layers
        mask = None
        if context_mask is not None:
            B, Q = block_token_ids.shape
            blk = torch.ones((B, Q), dtype=torch.bool, device=block_token_ids.device)
            mask = torch.cat([context_mask.bool(), blk], 1)[:, None, :].expand(B, Q, -1)
        return self.run_blocks(block_token_ids, block_positions, kv, mask, logit_positions=logit_positions)


def make_block(root_ids: torch.Tensor, start_positions: torch.Tensor, block_size: int, mask_token_id: int = MASK_TOKEN_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """``[root, MASK × (bs−1)]`` token ids and positions ``p..p+bs−1`` for roots [B] at positions [B]."""
    B = root_ids.shape[0]
    ids = torch.full((B, block_size), mask_token_id, dtype=torch.long, device=root_ids.device)
    ids[:, 0] = root_ids
    pos = start_positions[:, None] + torch.arange(block_size, device=root_ids.device)
    return ids, pos


@dataclass
class DrafterKVCache:
    """Projected context K/V of committed tokens, per drafter layer ([B, kvh, C, hd] each).

    ``append`` adds newly committed tokens; ``crop`` keeps a subset of columns (e.g. after a
    rejected speculation, or to drop padding) by index or by length.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.layers else self.layers[0][0].shape[2]

    def append(self, new: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.layers:
            self.layers = [(k, v) for k, v in new]
        else:
            self.layers = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.layers, new)]

    def crop(self, keep: int | torch.Tensor) -> None:
        """Keep the first ``keep`` columns (int) or the given column indices (1-D LongTensor)."""
        if isinstance(keep, int):
            self.layers = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self.layers]
        else:
            self.layers = [(k.index_select(2, keep), v.index_select(2, keep)) for k, v in self.layers]
