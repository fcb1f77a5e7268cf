"""KV compaction in vLLM's paged caches after a tree walk (target and drafter alike).

A verify step writes tree row i of request r at logical position ctx_r + i. After the walk the
accepted path's rows must sit at ctx_r + depth so that the next step (and the scheduler's rollback
of num_computed_tokens to ctx_r + accepted + 1) sees exactly the committed text. The moves come
from `vllm_ddtree.tree.compaction_plan` as logical positions, or from `path_row_moves` as verify
rows (what a verify step's row index maps); here they become physical slots and are applied to
every layer's cache: gather all sources, then scatter (a source is never before its destination,
and no-op entries copy the root onto itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_ddtree.tree import KVCompaction, TreeBatch, WalkResult, constants, path_slot_moves


def positions_to_slots(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Logical positions [R, L] -> physical slots (block * block_size + offset) via block_table [R, B]."""
    blocks = block_table.long().gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def compact_paged_kv_(kv_caches: list[Tensor], block_table: Tensor, plan: KVCompaction, block_size: int,
                      layout: str = "rows") -> None:
    """Apply `plan` to every layer cache [blocks, kv_heads, block_size, 2 * head_dim] in `layout`
    (see `move_slots_`). No host synchronisation."""
    src = positions_to_slots(block_table, plan.src, block_size).reshape(-1)
    dst = positions_to_slots(block_table, plan.dst, block_size).reshape(-1)
    move_slots_(kv_caches, src, dst, layout)


def cache_rows(blocks: Tensor, offsets: Tensor, num_kv_heads: int, block_size: int) -> Tensor:
    """Rows of a "rows"-layout layer cache read as one [blocks * kv_heads * 2 * block_size, head_dim]
    matrix that hold K (index 0 of the last dim) and V (1) of each (block, offset):
    [*blocks.shape, kv_heads, 2]. Per (block, head) the storage is [2 * block_size, head_dim], K rows
    first (:mod:`vllm_ddtree.attention.cpu_tree`).
    """
    heads = torch.arange(num_kv_heads, device=blocks.device).view(-1, 1)
    k_or_v = torch.arange(2, device=blocks.device)
    return ((blocks[..., None, None] * num_kv_heads + heads) * 2 + k_or_v) * block_size + offsets[..., None, None]


def cpu_attn_elements(blocks: Tensor, offsets: Tensor, num_kv_heads: int, block_size: int, head_dim: int,
                      layout: str = "cpu_attn") -> Tensor:
    """Elements of a CPU_ATTN-written layer cache (vLLM's storage, flattened) that hold K (index 0 of
    dim -2) and V (1) of each (block, offset): [*blocks.shape, kv_heads, 2, head_dim]. Per (block,
    head) K then V, each block_size * head_dim values; inside them, by the ISA that wrote them:

    - "cpu_attn" (vec, vec16): K as [head_dim, block_size] (transposed), V as [block_size, head_dim];
    - "cpu_attn_amx" (AMX tiles, 16 rows of bf16 pairs): K as [block_size / 16, head_dim / 2, 16, 2]
      (token t, dim d at [t // 16, d // 2, t % 16, d % 2]), V as [head_dim / 16, block_size / 2, 16, 2]
      (at [d // 16, t // 2, d % 16, t % 2]).
    """
    heads = torch.arange(num_kv_heads, device=blocks.device).view(-1, 1, 1)
    k_or_v = torch.arange(2, device=blocks.device).view(-1, 1)
    d = torch.arange(head_dim, device=blocks.device)
    base = ((blocks[..., None, None, None] * num_kv_heads + heads) * 2 + k_or_v) * (block_size * head_dim)
    t = offsets[..., None, None, None]
    if layout == "cpu_attn_amx":
        k = ((t // 16) * (head_dim // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
        v = ((d // 16) * (block_size // 2) + t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        k, v = d * block_size + t, t * head_dim + d
    return base + torch.where(k_or_v == 0, k, v)


LAYOUTS = ("rows", "cpu_attn", "cpu_attn_amx", "flashinfer")


#: Bytes of K/V one gather of `move_slots_` may hold at once (the layers of a stack are moved in
#: chunks below it): vLLM's memory profiling never sees this transient.
MOVE_CHUNK_BYTES = 64 << 20


def layer_stacks(kv_caches: list[Tensor]) -> list[Tensor]:
    """The layer caches as [layers, *shape] views, as few as their storage allows.

    vLLM 0.32.0 places every layer of a KV cache tensor in one allocation, a fixed stride apart
    (`vllm.v1.worker.utils.allocate_kv_cache`): consecutive layers that are views of one storage
    with the same shape, strides and dtype, each the same number of elements after the previous,
    are one strided view, so a move costs the same two ops for all of them as for one layer. Any
    other cache (separate allocations, as tests make) is a stack of its own.
    """
    stacks: list[list[Tensor]] = []
    for cache in kv_caches:
        run = stacks[-1] if stacks else None
        if (run and cache.shape == run[0].shape and cache.stride() == run[0].stride()
                and cache.dtype == run[0].dtype and cache.device == run[0].device
                and cache.untyped_storage().data_ptr() == run[0].untyped_storage().data_ptr()):
            step = cache.storage_offset() - run[-1].storage_offset()
            if step > 0 and (len(run) == 1 or step == run[1].storage_offset() - run[0].storage_offset()):
                run.append(cache)
                continue
        stacks.append([cache])
    out = []
    for run in stacks:
        first = run[0]
        step = run[1].storage_offset() - first.storage_offset() if len(run) > 1 else first.numel()
        out.append(torch.as_strided(first, (len(run), *first.shape), (step, *first.stride()), first.storage_offset()))
    return out


def move_slots_(kv_caches: list[Tensor], src_slots: Tensor, dst_slots: Tensor, layout: str = "rows") -> None:
    """cache[dst] = cache[src] for physical slots in every layer cache, gather first (src_slots and
    dst_slots of one shape, any: a verify step's [R, depth] moves as they are). `CacheStacks` made
    and used once; an engine keeps its `CacheStacks` and moves through it every step."""
    CacheStacks.of(kv_caches, layout).move_(src_slots, dst_slots)


@dataclass(frozen=True)
class CacheStacks:
    """A model's layer caches, checked and grouped into strided stacks once (`of`), then moved every
    step (`move_`) without looking at each layer again (done every step, that was 12 lines of Python
    per layer: with 36 layers, half of what a captured steady step runs).

    The backends' layer caches are all [blocks, kv_heads, block_size, 2 * head_dim]; they differ inside
    (:mod:`vllm_ddtree.attention.cpu_tree` on the CPU): "cpu_attn" and "cpu_attn_amx" (vLLM's CPU_ATTN
    storage, `cpu_attn_elements`) hold per (block, head) K then V, each permuted within the block, "rows"
    per (block, head) K rows then V rows, "flashinfer"
    (vLLM's FlashInfer backend, ``do_kv_cache_update``) K then V in the last dimension of each token.
    The logical view is indexed, so FlashInfer's physical layouts (NHD, HND) need nothing. The indices
    are computed once for all layers (layers of one model share the cache's shape), and the layers
    are moved a stack at a time (`layer_stacks`): two ops per stack (per chunk of `MOVE_CHUNK_BYTES`
    of gathered K/V), not per layer.
    """

    layout: str
    shape: tuple[int, int, int, int]  # (blocks, kv_heads, block_size, 2 * head_dim) of every layer
    stacks: tuple[Tensor, ...]  # [layers, blocks, ...] per stack; [layers, rows, row] for the flat layouts

    @classmethod
    def of(cls, kv_caches: list[Tensor], layout: str = "rows") -> "CacheStacks":
        """Checks the layer caches (one shape; contiguous for the flat layouts) and stacks them."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {LAYOUTS}")
        if not kv_caches:
            return cls(layout, (0, 0, 0, 0), ())
        nb, h, bs, two_hd = shape = tuple(kv_caches[0].shape)
        for cache in kv_caches:
            if cache.shape != shape:
                raise ValueError(f"layer caches differ in shape: {tuple(cache.shape)} vs {shape}")
            if layout != "flashinfer" and not cache.is_contiguous():
                raise ValueError(f"a {layout!r} layer cache must be contiguous (its slots are flat indices)")
        stacks = layer_stacks(kv_caches)
        if layout != "flashinfer":  # [layers, rows, row]: each layer's flat view (contiguous, checked above)
            row = two_hd // 2 if layout == "rows" else 1  # K/V rows, or single elements
            stacks = [stack.as_strided((stack.shape[0], nb * h * bs * two_hd // row, row), (stack.stride(0), row, 1),
                                       stack.storage_offset()) for stack in stacks]
        return cls(layout, shape, tuple(stacks))

    def move_(self, src_slots: Tensor, dst_slots: Tensor) -> None:
        """cache[dst] = cache[src] for physical slots in every layer, gather first."""
        if not self.stacks:
            return
        _, h, bs, two_hd = self.shape
        sb, so = torch.div(src_slots, bs, rounding_mode="floor"), src_slots % bs
        db, do = torch.div(dst_slots, bs, rounding_mode="floor"), dst_slots % bs
        if self.layout == "rows":  # whole K and V rows of the cache read as a [rows, head_dim] matrix
            src_idx, dst_idx = cache_rows(sb, so, h, bs).reshape(-1), cache_rows(db, do, h, bs).reshape(-1)
        elif self.layout != "flashinfer":  # CPU_ATTN's: permuted within a block, single elements of the flat cache
            src_idx = cpu_attn_elements(sb, so, h, bs, two_hd // 2, self.layout).reshape(-1)
            dst_idx = cpu_attn_elements(db, do, h, bs, two_hd // 2, self.layout).reshape(-1)
        per_layer = src_slots.numel() * h * two_hd * self.stacks[0].element_size()  # gathered bytes per layer
        chunk = max(1, MOVE_CHUNK_BYTES // max(per_layer, 1))
        for stack in self.stacks:
            for start in range(0, stack.shape[0], chunk):
                part = stack if chunk >= stack.shape[0] else stack[start : start + chunk]
                if self.layout == "flashinfer":
                    # part[:, db, :, do] = part[:, sb, :, so], gathered ([moves, layers, heads, 2 * hd]) before the
                    # write; as aten calls, which (unlike indexing) add no view of the values for a single move
                    gathered = torch.ops.aten.index(part, [None, sb, None, so])
                    torch.ops.aten.index_put_(part, [None, db, None, do], gathered)
                else:
                    part.index_copy_(1, dst_idx, part.index_select(1, src_idx))  # gather first, then write


@dataclass
class PathMoves:
    """What a verify step does to the engine's buffers after the walk (see `accepted_path_moves`).

    src_slots, dst_slots [R * L]  physical KV slot moves for the target's caches (no-ops included)
    context_order        [T]      a permutation of the step's T tokens: each request's accepted
                                  path first, in path order, then its other rows
    """

    src_slots: Tensor
    dst_slots: Tensor
    context_order: Tensor


def accepted_path_moves(batch: TreeBatch, walk: WalkResult, row_index: Tensor, slot_mapping: Tensor) -> PathMoves:
    """KV moves and the drafter's context order for a walked verify step, on the tensors' device
    (what the verify step's device function computes, `path_slot_moves`, then `context_order`).

    batch: the step's `TreeBatch` [R, N]; walk: its `walk_tree` result; row_index [R, N]
    the flat index of each verify row among the step's T scheduled tokens (0 where padding);
    slot_mapping [T] each token's physical KV slot. No host synchronisation.
    """
    # (a walk may be wider than the deepest node: moves past it would be no-ops, on every layer)
    moves = path_slot_moves(walk.path_rows[:, : batch.max_depth + 1], walk.accepted_rows, batch.depths,
                            slot_mapping[row_index])
    t = slot_mapping.shape[0]
    return PathMoves(moves.src_slots.reshape(-1), moves.dst_slots.reshape(-1),
                     context_order(torch.where(batch.valid, row_index, t), moves.path_first, t))


def context_order(order_index: Tensor, path_first: Tensor, num_tokens: int) -> Tensor:
    """The step's T = `num_tokens` tokens reordered with each request's accepted path first.

    order_index [R, N]: each verify row's index among the T tokens, T where padding; path_first
    [R, N]: each request's rows, its accepted path first (`PathSlotMoves`). A request's valid rows
    come first and `path_first` permutes them among themselves, so the token at a valid row's index
    takes the index of the row in its place; every other token stays. No host read (no
    boolean-mask indexing: padding writes a spare last entry, dropped)."""
    t = num_tokens
    order = constants.arange(t + 1, order_index.device).scatter(
        0, order_index.reshape(-1), order_index.gather(1, path_first).reshape(-1))
    return order[:t]
