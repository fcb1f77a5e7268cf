"""The cost side of the automatic budget: a roofline of the target's forward per device profile, the
calibrated step-cost model (BASTION's T_draft + T_aux + T_verify: a linear fit to measured step
times, a residual per measured step size, an online EMA correction), and its online calibration.

Verify time comes from a roofline of the target's forward (BASTION appendix F, generalised to a
batch: weights are read once per step, FLOPs and activations grow with the step's total tokens).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .transfer import to_device

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
    At batch 1 this is BASTION's appendix F, eqs. (8) and (9). Both are linear in the totals: the
    coefficients (`_roofline_terms`) are computed once per model and device, so a step evaluates
    the roofline in seven tensor ops (each term added with `add`'s multiplier: no product of its own).
    """
    f_tok, f_pair, b_const, b_tok, b_ctx, b_pair = _roofline_terms(shape, profile)
    if not any(isinstance(x, Tensor) for x in (tokens, attn_pairs, context_total)):
        return max(tokens * f_tok + attn_pairs * f_pair,
                   tokens * b_tok + context_total * b_ctx + attn_pairs * b_pair + b_const)
    tokens, attn_pairs, context_total = (torch.as_tensor(x) for x in (tokens, attn_pairs, context_total))
    t_flops = torch.add(tokens * f_tok, attn_pairs, alpha=f_pair)
    t_bytes = torch.add(torch.add(context_total * b_ctx + b_const, tokens, alpha=b_tok), attn_pairs, alpha=b_pair)
    return torch.maximum(t_flops, t_bytes)


@functools.lru_cache(maxsize=32)
def _roofline_terms(shape: ModelShape, profile: DeviceProfile) -> tuple[float, ...]:
    """Seconds per unit of each step total, from the roofline's FLOPs and bytes:

        FLOPs = L (4 S h hq + 4 S h hkv + 4 P hq + 6 S h hf) + 2 S h V
        bytes = bpp (2 V h + S (h + V) + L (2 h (hq + hkv) + 3 h hf + 2 hkv (C + 2 S) + 4 S (h + hq + hf) + 2 nq P))

    -> (FLOP seconds per token, per attention pair; byte seconds constant, per token, per context
    token, per attention pair)."""
    L, h, V = shape.layers, shape.hidden, shape.vocab
    hq, hkv, hf, nq = shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn, shape.q_heads
    bpp, peak, bw = shape.bytes_per_param, profile.peak_flops, profile.bandwidth
    return (
        (L * (4 * h * hq + 4 * h * hkv + 6 * h * hf) + 2 * h * V) / peak,
        L * 4 * hq / peak,
        bpp * (2 * V * h + L * (2 * h * (hq + hkv) + 3 * h * hf)) / bw,
        bpp * ((h + V) + L * (4 * hkv + 4 * (h + hq + hf))) / bw,
        bpp * L * 2 * hkv / bw,
        bpp * L * 2 * nq / bw,
    )


#: CostModel attributes a step reads on the device (through `CostModel.coefficients`)
_MIRRORED = ("slope", "per_token", "knee", "intercept", "correction", "t_draft", "t_aux", "residual")


@dataclass
class CostCoefficients:
    """A `CostModel`'s numbers as 0-dim tensors on one device (`fixed` = t_draft + t_aux), and its
    residual table in a buffer with zeros past the table's end, as long as the model's `max_step_rows`
    (at least `MIN_CAPACITY`). Updated in place when the model's attributes change; the buffer is
    replaced (twice as long) only when a table outgrows it, and a capture made before then must be
    made again."""

    slope: Tensor
    per_token: Tensor
    knee: Tensor
    intercept: Tensor
    correction: Tensor
    fixed: Tensor
    residual: Tensor  # [capacity] seconds by step size in rows
    generation: int = 0  # how many times `residual` was replaced (a capture holds the buffer of its generation)

    MIN_CAPACITY = 1024  # step sizes in rows a first buffer covers (it doubles past them)

    @classmethod
    def of(cls, model: "CostModel", device: torch.device, dtype: torch.dtype) -> "CostCoefficients":
        scalar = lambda v: torch.tensor(float(v), dtype=dtype, device=device)  # noqa: E731
        # sizes 0..max_step_rows, and one zero past them (what a larger size reads)
        capacity = max(cls.MIN_CAPACITY, model.max_step_rows + 2)
        out = cls(scalar(model.slope), scalar(model.per_token), scalar(model.knee), scalar(model.intercept),
                  scalar(model.correction), scalar(model.t_draft + model.t_aux),
                  torch.zeros(capacity, dtype=torch.float32, device=device))
        out.refresh(model, "residual")
        return out

    def refresh(self, model: "CostModel", name: str) -> None:
        """Copy the model's attribute `name` here, in place (queued to the device, no host wait)."""
        if name in ("t_draft", "t_aux"):
            self.fixed.fill_(model.t_draft + model.t_aux)
        elif name != "residual":
            getattr(self, name).fill_(float(getattr(model, name)))
        else:
            table = model.residual
            n = 0 if table is None else table.numel()
            if n + 1 > self.residual.numel():  # a larger table: a new buffer (a capture must be made again)
                self.residual = torch.zeros(max(2 * self.residual.numel(), n + 1), dtype=torch.float32,
                                            device=self.residual.device)
                self.generation += 1
            self.residual.zero_()
            if n:
                self.residual[:n].copy_(to_device(table.detach().float(), self.residual.device))


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
    # The largest step in rows the model is asked about (the scheduler's max_num_batched_tokens), 0 if
    # unknown. The residual's device buffer (`coefficients`) covers it from the start, so no refit has
    # to replace it, and no captured step has to be captured again: at 64 requests a 65-row tree each
    # is a 4160-row step, past the default buffer.
    max_step_rows: int = 0

    def __post_init__(self) -> None:
        if self.max_step_rows < 0:
            raise ValueError(f"max_step_rows must be >= 0 (0: unknown), got {self.max_step_rows}")
        if min(self.intercept, self.t_draft, self.t_aux, self.per_token, self.knee) < 0 or self.slope <= 0:
            raise ValueError("cost model needs slope > 0 and non-negative intercept, per_token, knee, t_draft, t_aux")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in _MIRRORED and "_mirrors" in self.__dict__:
            for mirror in self._mirrors.values():
                mirror.refresh(self, name)

    def coefficients(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> "CostCoefficients":
        """The fitted numbers as 0-dim tensors of `dtype` on `device`, kept equal to the attributes
        in place.

        What a step computes on the device reads these, not the Python numbers: a CUDA graph (or a
        trace) freezes a number at its capture value but reads a tensor where it lies, so a refit
        that writes them in place reaches every later replay. Of the step's own float dtype, so
        they compute as the Python numbers did (a number takes the tensor's dtype).
        """
        key = (torch.device(device), dtype)
        mirrors = self.__dict__.setdefault("_mirrors", {})
        if key not in mirrors:
            mirrors[key] = CostCoefficients.of(self, *key)
        return mirrors[key]

    def verify_seconds(self, tokens, attn_pairs, context_total):
        """Calibrated verify time for a step with these totals (see `roofline_seconds`)."""
        raw = roofline_seconds(self.shape, self.profile, tokens, attn_pairs, context_total)
        tokens = torch.as_tensor(tokens)
        c = self.coefficients(tokens.device, torch.float64 if tokens.dtype == torch.float64 else torch.float32)
        rows = (tokens - c.knee).clamp(min=0)
        smooth = torch.addcmul(c.intercept, c.slope, raw).addcmul_(c.per_token, rows)  # slope raw + per_token rows
        # torch.take, not residual[size]: indexing with a 0-dim tensor converts it to a Python int, a
        # host sync (and a failed CUDA-graph capture) at every step. Past the table's end the buffer
        # holds zeros, and a size past the buffer reads its last entry, also zero.
        size = tokens.round().long().clamp(0, c.residual.numel() - 1)
        return smooth + torch.take(c.residual, size)

    def step_seconds(self, tree_tokens, context_total, num_requests: int | Tensor = 1):
        """Predicted cycle time of a step with `tree_tokens` draft nodes over `num_requests` requests.

        Broadcasts over tensors. Each request also verifies its root row. The attention term assumes
        the nodes are spread evenly over the requests, so the cost depends on the totals only (what
        makes the batch allocation a single best-first merge).
        """
        r = num_requests
        s = torch.as_tensor(tree_tokens, dtype=torch.float32) + r
        ctx = torch.as_tensor(context_total, dtype=torch.float32)
        pairs = s * (ctx + s) / r  # sum over requests of s_r (c_r + s_r), s_r = s / r, c_r = ctx / r
        verify = self.verify_seconds(s, pairs, ctx)
        c = self.coefficients(s.device)  # (s is float32)
        return c.correction * (c.fixed + verify)

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
