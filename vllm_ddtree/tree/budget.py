"""Tree budget per step from a hardware cost model (BASTION), for one request or a whole batch.

Expected accepted length of the best N-node tree: A(N) = 1 + sum of the first N nodes' prefix
probabilities under the drafter (the root/bonus token always counts 1). Along the best-first order
the gains are non-increasing, so A is concave; with PRESTO rescoring the order can put a less
probable prefix first, so gains are made non-increasing with a running minimum (a lower bound that
keeps A concave and the batch merge prefix-consistent).

Cycle cost C = T_draft + T_aux + T_verify, T_verify from a roofline of the target's forward
(BASTION appendix F, generalised to a batch: weights are read once per step, FLOPs and activations
grow with the step's total tokens), times a linear calibration fitted to measured step times and an
online EMA correction. Estimated speedup A(N) / C(N) is maximised exactly over [min, max] budget
with a cumulative sum and an argmax on device (no host round trip, no first-descent heuristic).

Batch-aware allocation: one step verifies every request's tree together, so the cost depends on the
*total* number of tree tokens. `allocate_batch` merges all requests' (non-increasing) gains in one
best-first order and picks the total that maximises the batch's estimated tokens per second; for
separable concave gains and a cost of the total this is optimal, hence never worse than letting each
request choose alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DeviceProfile:
    """Peak dense FLOP/s and memory bandwidth (bytes/s) of a device, for the roofline."""

    name: str
    peak_flops: float
    bandwidth: float


# Published peaks (dense, no sparsity): H100 SXM 989 TFLOP/s bf16, 3.35 TB/s; H200 SXM 989 TFLOP/s
# bf16, 4.8 TB/s. The CPU entry is this project's 2-core AVX-512 machine in float32 (2 cores x 2 FMA
# units x 16 lanes x 2 FLOP x ~2.5 GHz; ~20 GB/s); calibration absorbs the rest.
PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", 3.2e11, 2.0e10),
    "h100": DeviceProfile("h100", 989e12, 3.35e12),
    "h200": DeviceProfile("h200", 989e12, 4.8e12),
}


def get_profile(name: str, peak_flops: float | None = None, bandwidth: float | None = None) -> DeviceProfile:
    """A named profile, with optional overrides of its peak FLOP/s or bandwidth."""
    if name not in PROFILES:
        raise ValueError(f"unknown device profile {name!r}; choose one of {sorted(PROFILES)} or pass numbers")
    base = PROFILES[name]
    prof = DeviceProfile(base.name, peak_flops or base.peak_flops, bandwidth or base.bandwidth)
    if prof.peak_flops <= 0 or prof.bandwidth <= 0:
        raise ValueError(f"device profile needs positive peak_flops and bandwidth, got {prof}")
    return prof


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only target that its forward cost depends on."""

    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    bytes_per_param: int

    @classmethod
    def from_hf_config(cls, config, dtype: str = "bfloat16") -> "ModelShape":
        """From a transformers config (Llama/Qwen-style field names) and the serving dtype."""
        dtype = str(dtype).replace("torch.", "")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r} for the cost model; use one of {sorted(_DTYPE_BYTES)}")
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        q_heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // q_heads
        return cls(
            layers=get("num_hidden_layers"),
            hidden=get("hidden_size"),
            q_heads=q_heads,
            kv_heads=get("num_key_value_heads") or q_heads,
            head_dim=head_dim,
            ffn=get("intermediate_size"),
            vocab=get("vocab_size"),
            bytes_per_param=_DTYPE_BYTES[dtype],
        )


def roofline_seconds(shape: ModelShape, profile: DeviceProfile, tokens, attn_pairs, context_total, num_requests=1):
    """Roofline time of one verify forward: max(FLOPs / peak, bytes / bandwidth). Broadcasts tensors.

    tokens: total new tokens S in the step; attn_pairs: sum over requests of s_r * (c_r + s_r);
    context_total: sum of cached context lengths; num_requests only enters through these sums.
    At batch 1 this is BASTION's appendix F, eqs. (8) and (9).
    """
    L, h, V = shape.layers, shape.hidden, shape.vocab
    hq, hkv, hf, nq = shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn, shape.q_heads
    S, P, Ctot = tokens, attn_pairs, context_total
    flops = L * (4 * S * h * hq + 4 * S * h * hkv + 4 * P * hq + 6 * S * h * hf) + 2 * S * h * V
    bytes_ = shape.bytes_per_param * (
        2 * V * h
        + S * (h + V)
        + L * (2 * h * (hq + hkv) + 3 * h * hf + 2 * hkv * (Ctot + 2 * S) + 4 * S * (h + hq + hf) + 2 * nq * P)
    )
    t_flops = flops / profile.peak_flops
    t_bytes = bytes_ / profile.bandwidth
    if isinstance(t_flops, Tensor) or isinstance(t_bytes, Tensor):
        return torch.maximum(torch.as_tensor(t_flops), torch.as_tensor(t_bytes))
    return max(t_flops, t_bytes)


@dataclass
class CostModel:
    """Calibrated cycle cost of a speculative step: T_draft + T_aux + slope * roofline + intercept.

    `fit` sets slope/intercept from measured verify times; `observe` keeps an EMA of measured over
    predicted step time and scales predictions by it (BASTION's "EMA + Calib").
    """

    shape: ModelShape
    profile: DeviceProfile
    t_draft: float = 0.0
    t_aux: float = 0.0
    slope: float = 1.0
    intercept: float = 0.0
    ema_alpha: float = 0.1
    correction: float = 1.0

    def __post_init__(self) -> None:
        if self.slope <= 0 or self.intercept < 0 or self.t_draft < 0 or self.t_aux < 0:
            raise ValueError("cost model needs slope > 0 and non-negative intercept, t_draft, t_aux")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")

    def verify_seconds(self, tokens, attn_pairs, context_total):
        """Calibrated verify time for a step with these totals (see `roofline_seconds`)."""
        raw = roofline_seconds(self.shape, self.profile, tokens, attn_pairs, context_total)
        return self.slope * raw + self.intercept

    def step_seconds(self, tree_tokens, context_total, num_requests: int = 1):
        """Predicted cycle time of a step with `tree_tokens` draft nodes over `num_requests` requests.

        Broadcasts over tensors. Each request also verifies its root row. The attention term assumes
        the nodes are spread evenly over the requests, so the cost depends on the totals only (what
        makes the batch allocation a single best-first merge).
        """
        r = num_requests
        s = torch.as_tensor(tree_tokens, dtype=torch.float32) + r
        ctx = torch.as_tensor(context_total, dtype=torch.float32)
        pairs = s * ctx / r + s * s / r
        verify = self.verify_seconds(s, pairs, ctx)
        return self.correction * (self.t_draft + self.t_aux + verify)

    def fit(self, tokens: Tensor, attn_pairs: Tensor, context_total: Tensor, seconds: Tensor) -> None:
        """Least-squares slope and intercept of measured verify seconds against the roofline."""
        x = roofline_seconds(self.shape, self.profile, tokens.double(), attn_pairs.double(), context_total.double())
        y = seconds.double()
        if x.numel() < 2:
            raise ValueError("calibration needs at least two measured points")
        xm, ym = x.mean(), y.mean()
        var = ((x - xm) ** 2).sum()
        slope = float(((x - xm) * (y - ym)).sum() / var) if var > 0 else float(ym / xm)
        slope = max(slope, 1e-12)
        self.slope = slope
        self.intercept = max(float(ym - slope * xm), 0.0)

    def observe(self, predicted: float, measured: float) -> None:
        """Online drift correction: EMA of measured / predicted step time."""
        if predicted > 0 and measured > 0 and math.isfinite(measured):
            self.correction = (1 - self.ema_alpha) * self.correction + self.ema_alpha * (
                measured / predicted * self.correction
            )


def node_gains(draft_logp: Tensor) -> Tensor:
    """Per-node acceptance gains [R, B] along the best-first order, made non-increasing; 0 if invalid."""
    g = torch.where(torch.isfinite(draft_logp), draft_logp.float().exp(), 0.0)
    return torch.cummin(g, dim=1).values


@dataclass
class BudgetPlan:
    """Budgets for one step and the estimate that chose them.

    budgets            [R] int64   draft nodes per request
    expected_tokens    []  float   sum over requests of A_r(budget_r), bonus tokens included
    step_seconds       []  float   predicted cycle time of the step
    tokens_per_second  []  float   expected_tokens / step_seconds
    """

    budgets: Tensor
    expected_tokens: Tensor
    step_seconds: Tensor
    tokens_per_second: Tensor


def _check_bounds(min_budget: int, max_budget: int, width: int) -> None:
    if min_budget < 1:
        raise ValueError(f"min_budget must be >= 1, got {min_budget}")
    if max_budget < min_budget:
        raise ValueError(f"max_budget ({max_budget}) must be >= min_budget ({min_budget})")
    if width < max_budget:
        raise ValueError(f"the tree has {width} node slots but max_budget is {max_budget}; build it at max_budget")


def batch_estimate(draft_logp: Tensor, budgets: Tensor, context_lens: Tensor, cost: CostModel) -> BudgetPlan:
    """The batch's estimated throughput for a given allocation (the objective `allocate_batch` maximises)."""
    gains = node_gains(draft_logp)
    take = torch.arange(gains.shape[1], device=gains.device)[None, :] < budgets[:, None]
    expected = (gains * take).sum() + gains.shape[0]
    secs = cost.step_seconds(budgets.sum(), context_lens.sum(), context_lens.numel())
    return BudgetPlan(budgets, expected, secs, expected / secs)


def choose_budgets(
    draft_logp: Tensor, context_lens: Tensor, cost: CostModel, min_budget: int = 1, max_budget: int | None = None
) -> BudgetPlan:
    """Per-request BASTION: each request maximises A(N) / C(N) with its own batch-1 cost.

    draft_logp [R, B]: `DraftTree.draft_logp` (best-first). Returns the argmax of each request's own
    estimate over N in [min_budget, max_budget]; the plan's totals are evaluated as one batch step.
    """
    r, width = draft_logp.shape
    max_budget = max_budget or width
    _check_bounds(min_budget, max_budget, width)
    gains = node_gains(draft_logp)[:, :max_budget]
    n = torch.arange(1, max_budget + 1, device=gains.device, dtype=torch.float32)
    accepted = 1.0 + torch.cumsum(gains, dim=1)  # [R, N]
    speed = accepted / cost.step_seconds(n[None, :], context_lens.float()[:, None], 1)
    speed[:, : min_budget - 1] = -math.inf
    budgets = speed.argmax(dim=1) + 1
    return batch_estimate(draft_logp, budgets, context_lens, cost)


def allocate_batch(
    draft_logp: Tensor, context_lens: Tensor, cost: CostModel, min_budget: int = 1, max_budget: int | None = None
) -> BudgetPlan:
    """Batch-aware BASTION: one best-first over all requests' nodes against the batch step cost.

    Every request gets at least `min_budget` nodes; the remaining node slots (up to `max_budget`
    each) are merged across requests by gain, and the total that maximises the batch's expected
    tokens per second is kept. Runs on device: a sort, a cumulative sum, an argmax.
    """
    r, width = draft_logp.shape
    max_budget = max_budget or width
    _check_bounds(min_budget, max_budget, width)
    gains = node_gains(draft_logp)[:, :max_budget]
    forced = gains[:, :min_budget].sum()
    optional = gains[:, min_budget:]  # [R, W]
    w = optional.shape[1]
    flat = optional.reshape(-1)
    # Stable sort: equal gains keep (request, position) order, so each request's picks stay a prefix.
    order = torch.sort(flat, descending=True, stable=True).indices
    cum = torch.cat([torch.zeros(1, device=flat.device), torch.cumsum(flat[order], dim=0)])  # [R*W + 1]
    extra = torch.arange(r * w + 1, device=flat.device, dtype=torch.float32)
    total_nodes = extra + r * min_budget
    expected = r + forced + cum
    speed = expected / cost.step_seconds(total_nodes, context_lens.sum(), r)
    best = speed.argmax()
    chosen = torch.arange(r * w, device=flat.device) < best
    picked = torch.zeros(r * w, dtype=torch.int64, device=flat.device).scatter_(0, order, chosen.long())
    budgets = min_budget + picked.view(r, w).sum(dim=1)
    return batch_estimate(draft_logp, budgets, context_lens, cost)
