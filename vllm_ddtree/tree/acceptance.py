"""The acceptance side of the automatic budget, learnt while decoding: how far to trust the drafter's
prefix probabilities (AcceptanceCalibration), and how often the prompt-lookup path is accepted at
each depth (LookupCalibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


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
    _beta: Tensor | None = field(default=None, repr=False, compare=False)  # [] `beta`, rewritten in place by each update

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not 0 < self.bin_decay <= 1:
            raise ValueError(f"bin_decay must be in (0, 1], got {self.bin_decay}")
        if self.prior <= 0:
            raise ValueError(f"prior must be > 0 pseudo-nodes, got {self.prior}")
        dev = self.betas.device
        if self.predicted is None:
            self.predicted = torch.zeros_like(self.betas)
        if self.accepted is None:
            self.accepted = torch.zeros((), device=dev)
        self.bin_edges = self.bin_edges.to(dev)
        bins = self.bin_edges.numel() + 1
        if self.bin_predicted is None:
            self.bin_predicted = torch.zeros(bins, device=dev)
        if self.bin_accepted is None:
            self.bin_accepted = torch.zeros(bins, device=dev)
        self._keep(torch.cat([self.predicted.float().reshape(-1), self.accepted.float().reshape(1)]).to(dev),
                   torch.stack([self.bin_predicted.float(), self.bin_accepted.float()]).to(dev))
        self._keep_beta(torch.ones((), device=dev))
        if self.updates:  # made with a state: its exponent
            self._fit_beta()

    def _keep_beta(self, beta: Tensor) -> None:
        self._beta, self._beta_out = beta, beta.view(1)

    def _keep(self, ema: Tensor, bin_sums: Tensor) -> None:
        # The state as two tensors, each updated by two in-place ops a step: `ema` [K + 1] the
        # candidates' predicted sums, then the measured one; `bin_sums` [2, E + 1] the bins' predicted
        # and accepted sums. The named fields are views of them.
        self._ema, self._bin_sums = ema, bin_sums
        self.predicted, self.accepted = ema[:-1], ema[-1]
        self.bin_predicted, self.bin_accepted = bin_sums.unbind(0)
        self._betas_column = self.betas.view(-1, 1)

    def _bins(self, draft_logp: Tensor) -> Tensor:
        # -inf (no node) lands in bin 0 with the lowest finite scores; callers mask it out or keep -inf.
        return torch.bucketize(draft_logp.contiguous(), self.bin_edges)

    def update(self, draft_logp: Tensor, verified: Tensor, accepted: Tensor) -> None:
        """draft_logp/verified/accepted [R, N] of the step: each node's score, whether it was verified,
        whether it is on the accepted path (nodes of infinite score are neither predicted nor counted)."""
        self.update_state(draft_logp, verified, accepted)
        self.updates += 1

    def update_state(self, draft_logp: Tensor, verified: Tensor, accepted: Tensor) -> None:
        """`update`'s device part (in place, no host count): what a captured verify step runs; its
        caller counts the update (`updates`) on the host."""
        dev = self.betas.device
        # elementwise on the inputs' shape (slices of a step's tensors: no copy to flatten them), flat
        # once each result is a fresh tensor
        lp = draft_logp.to(dev).float()
        counted = verified.to(dev) & (lp > -math.inf)  # (log-probabilities: never +inf)
        hit = (accepted.to(dev) & counted).float().reshape(-1)  # [R * N]
        lp = torch.where(counted, lp, -math.inf).reshape(-1)  # [R * N]
        # the bins' predictions use the exponent the budget uses right now
        self._bin_sums.mul_(self.bin_decay).index_add_(1, self._bins(lp), torch.stack([torch.exp(self.beta * lp), hit]))
        pred = torch.exp(self._betas_column * lp).sum(dim=1)  # [K]
        self._ema.mul_(1 - self.alpha).add_(torch.cat([pred, hit.sum(dim=0, keepdim=True)]), alpha=self.alpha)
        self._fit_beta()

    def _fit_beta(self) -> None:
        # Into the same tensor each time: a captured step (CUDA graph) reads the exponent where it lies.
        gap = (self.predicted.clamp(min=1e-6) / self.accepted.clamp(min=1e-6)).log().abs()
        # index_select, not betas[argmin]: indexing with a 0-d tensor reads it on the host (a sync).
        torch.index_select(self.betas, 0, gap.argmin(dim=0, keepdim=True), out=self._beta_out)

    @property
    def beta(self) -> Tensor:
        """[] the exponent whose predictions match the measured acceptances best (1 before any data):
        one tensor for the calibration's life on a device, made anew in place by each update."""
        return self._beta

    @property
    def reliability(self) -> Tensor:
        """[E + 1] each score bin's factor on p ** beta: accepted over predicted, with the prior."""
        return (self.bin_accepted + self.prior) / (self.bin_predicted + self.prior)

    def to(self, device: torch.device | str) -> "AcceptanceCalibration":
        """This calibration with its state on `device` (in place; returns self)."""
        self.betas, self.bin_edges = self.betas.to(device), self.bin_edges.to(device)
        self._keep(self._ema.to(device), self._bin_sums.to(device))
        self._keep_beta(self._beta.to(device))
        return self

    def rescale(self, draft_logp: Tensor) -> Tensor:
        """Calibrated log acceptance probabilities (same shape, at most 0; -inf stays -inf)."""
        dev = draft_logp.device
        bins = self._bins(draft_logp.to(self.bin_edges.device))
        factor = self.reliability.log().take(bins).to(dev)  # (take: any index shape, no 0-dim host read)
        return torch.addcmul(factor, draft_logp, self.beta.to(dev)).clamp_(max=0.0)  # draft_logp * beta + factor


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
        self._keep(torch.stack([self.hits.float(), self.at_risk.float()]))

    def _keep(self, state: Tensor) -> None:
        # One [2, L] tensor, `hits` and `at_risk` its rows: an update is two in-place ops on it.
        self._state = state
        self.hits, self.at_risk = state.unbind(0)

    def to(self, device: torch.device | str) -> "LookupCalibration":
        """This calibration with its state on `device` (in place; returns self)."""
        self._keep(self._state.to(device))
        return self

    def update(self, proposed: Tensor, valid: Tensor, committed: Tensor) -> None:
        """proposed/valid [R, L]: last step's lookup paths; committed [R, K]: the tokens that step
        committed, -1 padded (a row with none, e.g. a request new to the batch, has valid all False)."""
        dev = self._state.device
        proposed, valid, committed = proposed.to(dev), valid.to(dev), committed.to(dev)
        length = proposed.shape[1]
        # committed cut or -1 padded to the path's length (-1 matches no token)
        step = (committed[:, :length] if committed.shape[1] >= length
                else torch.nn.functional.pad(committed, (0, length - committed.shape[1]), value=-1))
        committed_at = step >= 0  # [R, L] the step committed a token at this depth (a prefix)
        same = (proposed == step) & valid  # (a proposed token is >= 0: never equal to the padding)
        hit = same.int().cummin(dim=1).values  # [R, L] 1 at the accepted depths (a prefix)
        # at risk: proposed where the step committed a token and the parent was accepted (depth 1's
        # parent is the root)
        at_risk = valid & committed_at & torch.nn.functional.pad(hit[:, :-1], (1, 0), value=1)
        self._state.mul_(1 - self.alpha).add_(torch.stack([hit, at_risk]).sum(dim=1, dtype=torch.float32),
                                              alpha=self.alpha)

    @property
    def acceptance(self) -> Tensor:
        """[L] predicted acceptance of a lookup node at each depth (its parent's times its own given it)."""
        return torch.cumprod(self.hits / self.at_risk.clamp(min=1e-6), dim=0)  # hits <= at_risk: each factor <= 1

    def gains(self, valid: Tensor) -> Tensor:
        """[R, L] predicted acceptance of each proposed node (0 where the path has none)."""
        return torch.where(valid.to(self.hits.device), self.acceptance, 0.0)  # ([L] broadcast over the rows)
