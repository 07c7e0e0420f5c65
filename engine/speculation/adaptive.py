"""Adaptive proposal length: whether one more drafted token pays for its verification rows."""
from __future__ import annotations

from dataclasses import dataclass, field

from .drafters import CANONICAL, LOOKUP, MODEL

__all__ = ["AdaptiveLength"]


@dataclass
class AdaptiveLength:
    """Decides per proposal whether drafting one more token pays (adaptive proposal length).

    A proposal (with the grammar-forced run that follows it) joins the chain when its expected
    saving exceeds its expected cost (Leviathan et al. 2023, sec. 3.4, applied per token). With
    P = P(it and every proposal before it are accepted) and `rows` its row plus the forced run:
    accepted, it saves the next step's forward overhead, t(1) minus one row's marginal cost (its
    rows would be computed by that step anyway); rejected, its rows are wasted:

        P * (t(1) - (t(T + 1) - t(T)))  >  (1 - P) * (t(T + rows) - t(T)) + t_draft

    where t(T) is the target forward time over T tokens, fitted online - separately for T = 1
    (the single-token decode path is cheaper per token than a multi-token forward on CPU) and
    as t0 + t1 * T for T > 1 - and t_draft
    the measured drafting time per proposal. P multiplies per-proposal estimates: the draft
    model's top probability (its confidence tracks acceptance; EAGLE-2, Li et al. 2024) times a
    running calibration factor, or prompt lookup's running acceptance rate. When no proposal can
    pay - not even the best-case estimate covers one more row - a step does not draft at all and
    is plain decoding, except every `probe_every`-th such step, which verifies one proposal to
    keep the estimates current (the draft may be better on this session than it was lately).

    The draft model is also switched off as a whole while it does not pay (`model_on`): its
    running net value per call - the savings of its accepted proposals, minus the rows discarded
    after its rejected ones, minus the time of the call itself (which is spent whether or not it
    proposes) - must stay >= 0; while it is negative, only every `probe_every`-th would-be call is
    made, to keep measuring (README, "Speculative decoding", has what this costs and saves on a CPU).

    Attributes:
        max_k: most proposed tokens per step.
        decay: weight of the past in the running estimates (per verification).
        probe_every: steps without drafting between one-proposal probes.
        accept: running acceptance rate of all proposals (0..1), for reports.
    """

    max_k: int = 8
    decay: float = 0.9
    probe_every: int = 16
    accept: float = 0.7
    _hits: dict = field(default_factory=lambda: {MODEL: [1.4, 1.6, 2.0], LOOKUP: [1.2, 0.0, 2.0],
                                                 CANONICAL: [1.9, 0.0, 2.0]})  # acc, conf, n
    _t1: float = 0.0             # EMA seconds of a 1-token forward (0: none yet)
    _fit: list = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0, 0.0])  # T > 1: n, sT, sT2, sY, sTY
    _draft_s: float = 0.0        # seconds per proposal (EMA)
    _idle: int = 0               # steps without drafting since the last probe
    _model_value: float = 0.005  # seconds gained per draft-model call (EMA; starts on)
    _model_idle: int = 0         # draft-model calls skipped since the last probe

    def forward_s(self, n_tokens: int) -> float:
        """Modelled target forward time (seconds) over n_tokens new tokens."""
        n, st, st2, sy, sty = self._fit
        one = self._t1 or (sy / n if n else 0.05)
        if n_tokens <= 1:
            return one
        # Prior until measured: each extra token costs half a 1-token forward (a CPU forward over
        # a few tokens is compute-bound).
        if n < 1:
            return one * (1.0 + 0.5 * (n_tokens - 1))
        mean_t, mean_y = st / n, sy / n
        var = st2 / n - mean_t * mean_t
        slope = max((sty / n - mean_t * mean_y) / var, 0.0) if n >= 4 and var > 1e-6 else 0.5 * one
        return max(mean_y + slope * (n_tokens - mean_t), one)

    def estimate(self, source: str, confidence: float = 1.0) -> float:
        """Acceptance probability estimate (0..1) of one proposal: the model's `confidence`
        (its top probability) times its calibration, or prompt lookup's (or canonical text's)
        running rate."""
        acc, conf, n = self._hits[source]
        if source == MODEL:
            return min(1.0, confidence * acc / max(conf, 1e-6))
        return acc / max(n, 1e-6)

    def pays(self, p_all: float, rows_before: int, rows_after: int) -> bool:
        """Whether growing the verification from rows_before to rows_after tokens pays when the
        new proposal is accepted (with everything before it) with probability p_all. False
        until a 1-token forward has been timed (the saving t(1) is then unknown: plain steps
        first)."""
        if self._t1 == 0:
            return False
        extra = self.forward_s(rows_after) - self.forward_s(rows_before)
        saved = max(self.forward_s(1) - (self.forward_s(rows_before + 1) - self.forward_s(rows_before)), 0.0)
        return p_all * saved > (1.0 - p_all) * extra + self._draft_s

    def probe(self) -> bool:
        """Count a step that drafting would not pay for; True every `probe_every`-th such step,
        when one proposal is verified anyway to refresh the acceptance estimates."""
        self._idle += 1
        if self._idle >= self.probe_every:
            self._idle = 0
            return True
        return False

    def model_on(self) -> bool:
        """Whether to call the draft model now: while its net value per call is >= 0, else every
        `probe_every`-th time."""
        if self._model_value >= 0:
            return True
        self._model_idle += 1
        if self._model_idle >= self.probe_every:
            self._model_idle = 0
            return True
        return False

    def record(self, n_tokens: int, forward_s: float, proposals: list[tuple[str, float, bool]],
               draft_s: float, model_calls: int = 0, model_s: float = 0.0, discarded: int = 0) -> None:
        """Account one verification: a target forward over `n_tokens` tokens taking `forward_s`
        seconds, the `proposals` it verified as (source, confidence, accepted) in chain order
        (up to the first rejection), drafting `draft_s` seconds in all, of which `model_s` in
        `model_calls` draft-model calls; `discarded` chain tokens were rejected."""
        if model_calls:
            row = self.forward_s(n_tokens + 1) - self.forward_s(n_tokens)
            saved = max(self.forward_s(1) - row, 0.0)
            value = -model_s
            for src, _, ok in proposals:
                if src == MODEL:
                    value += saved if ok else -discarded * row
            self._model_value = 0.8 * self._model_value + 0.2 * value / model_calls
        w = self.decay
        for src, conf, ok in proposals:
            h = self._hits[src]
            h[0], h[1], h[2] = w * h[0] + ok, w * h[1] + conf, w * h[2] + 1.0
            self.accept = w * self.accept + (1 - w) * ok
        if proposals:
            per = draft_s / len(proposals)
            self._draft_s = per if self._draft_s == 0 else 0.8 * self._draft_s + 0.2 * per
        if n_tokens <= 1:
            self._t1 = forward_s if self._t1 == 0 else w * self._t1 + (1 - w) * forward_s
            return
        fit = self._fit
        for i, v in enumerate((1.0, n_tokens, n_tokens * n_tokens, forward_s, n_tokens * forward_s)):
            fit[i] = w * fit[i] + v
