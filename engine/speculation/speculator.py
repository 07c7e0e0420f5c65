"""The speculator: a session's drafters, draft-model state and adaptive length, building one chain per step.

Drafters are combined as a single chain, not a tree: verification is causal, a forward's cost on
the CPU grows with the rows it verifies, and most tool-call tokens are grammar-forced.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..device import to_device
from ..model import Transformer
from .adaptive import AdaptiveLength
from .draft_model import DEFAULT_DRAFT, DraftModel
from .drafters import CANONICAL, GRAMMAR, LOOKUP, MODEL, ForcedText, MessageMatch, PromptLookup

__all__ = ["SpecConfig", "Speculator"]


@dataclass
class SpecConfig:
    """What a session speculates with. `draft` defaults to None (no draft model): to change one
    setting of the engine's default (which holds the shipped draft), use
    `dataclasses.replace(engine.speculation, forced_text=False)`.

    Attributes:
        prompt_lookup: use `PromptLookup` proposals.
        forced_text: propose the canonical token of grammar-forced text (`ForcedText`).
        max_ngram / min_ngram: n-gram lengths for prompt lookup (tokens).
        lookup_window: tokens before the output that prompt lookup searches in copy order
            (see `PromptLookup`).
        draft: a `DraftModel` (shared by all sessions of the engine) or None.
        max_k: most proposed tokens per verification.
        adaptive: a proposal joins the chain only when it pays for its verification rows
            (`AdaptiveLength.pays`, from measured costs and acceptance); False: always up to max_k.
        lookup_below: with both drafters, a prompt-lookup proposal replaces the draft model's
            only when the model's top probability (after the grammar mask) is below this
            (0..1). Measured on held-out tool calls: model-first with this fallback agrees with
            the target more often than lookup-first (see `tokenspeed.draft.evaluate`).
        min_confidence: the draft model proposes only when its top probability (after the
            grammar mask) reaches this (0..1); below it, and with no prompt-lookup proposal, the
            chain ends there and the target decides that token itself. The draft's confidence
            tracks its acceptance (EAGLE-2, Li et al. 2024, sec. 3), so unsure proposals, which
            are mostly rejected, cost no verification rows. 0: always propose.
    Raises (on construction):
        TypeError: draft is not a `DraftModel`. ValueError: a length or probability out of range.
    """

    prompt_lookup: bool = True
    forced_text: bool = True
    max_ngram: int = 3
    min_ngram: int = 1
    lookup_window: int = 512
    draft: DraftModel | None = field(default=None, repr=False)
    max_k: int = 8
    adaptive: bool = True
    lookup_below: float = 0.8
    min_confidence: float = 0.0

    def __post_init__(self):
        if self.draft is not None and not isinstance(self.draft, DraftModel):
            raise TypeError(f"SpecConfig.draft must be a DraftModel or None, got {type(self.draft).__name__}")
        if self.max_k < 1 or not 1 <= self.min_ngram <= self.max_ngram or self.lookup_window < 1:
            raise ValueError(f"SpecConfig: need max_k >= 1, 1 <= min_ngram <= max_ngram, lookup_window >= 1 "
                             f"(got {self.max_k}, {self.min_ngram}, {self.max_ngram}, {self.lookup_window})")
        if not (0.0 <= self.lookup_below <= 1.0 and 0.0 <= self.min_confidence <= 1.0):
            raise ValueError(f"SpecConfig: lookup_below and min_confidence are probabilities in [0, 1] "
                             f"(got {self.lookup_below}, {self.min_confidence})")

    @classmethod
    def default(cls, target: Transformer) -> "SpecConfig":
        """Prompt lookup plus the shipped draft model when it was trained for `target`."""
        draft = None
        if DEFAULT_DRAFT.is_file():
            try:
                draft = DraftModel.load(DEFAULT_DRAFT, target)
            except ValueError:
                draft = None  # another target model: no draft, prompt lookup and grammar runs only
        return cls(draft=draft)


class Speculator:
    """A session's drafting state: drafters, the draft KV cache and adaptive proposal length.

    Per chain position the canonical token of grammar-forced text is proposed first (`ForcedText`);
    then a copy from the last message (a prompt-lookup match there, or a `MessageMatch`); else the
    draft model, unless it is unsure (`SpecConfig.lookup_below`) and an older prompt-lookup match
    exists; with no match an unsure model ends the chain (`SpecConfig.min_confidence`). Every
    proposal is checked against the grammar, and joins the chain only when it pays
    (`AdaptiveLength`).
    """

    def __init__(self, config: SpecConfig | None, capacity: int, window: int | None = None):
        """config: drafters (None: plain decoding); capacity: the draft KV cache's tokens; window:
        the draft attends over the context's last window-1.5 window tokens only (`DraftState`;
        pruned sessions pass their KV budget; the draft's own trained `window` caps it), None:
        the draft's window (all of the context if it has none)."""
        self.config = config
        self.lookup = (PromptLookup(config.max_ngram, config.min_ngram, config.lookup_window)
                       if config and config.prompt_lookup else None)
        draft = config.draft if config else None
        if draft is not None and draft.window is not None:
            window = draft.window if window is None else min(window, draft.window)
        self.draft = draft.new_state(capacity, window) if draft is not None else None
        self.length = AdaptiveLength(max_k=config.max_k) if config else None
        self.token_texts: dict[int, str] = {}  # token id -> text, for `MessageMatch`
        self.model_calls, self.model_s = 0, 0.0  # draft-model calls (and seconds) since the last verification

    @property
    def enabled(self) -> bool:
        return self.lookup is not None or self.draft is not None or self.forced_text

    @property
    def forced_text(self) -> bool:
        """Whether grammar-forced text is proposed (`ForcedText`)."""
        return self.config is not None and self.config.forced_text

    def observe(self, context: np.ndarray | list[int]) -> None:
        """Prefill the draft's KV cache with the session's context ([N] int64 array or list: the token
        ids whose target KV is cached) as observations arrive, so that drafting at decision time prefills nothing."""
        if self.draft is not None:
            self.draft.sync(np.asarray(context, dtype=np.int64))  # no copy for an int64 array

    @property
    def max_k(self) -> int:
        """Most proposals per step (0: plain decoding)."""
        return self.config.max_k if self.enabled else 0

    def chain(self, context: np.ndarray | list[int], k: int, matcher, allowed, jump_forward: bool, budget: int,
              temperature: float, generator: torch.Generator | None = None,
              source: tuple[int, int] | None = None, n_fed: int = 1, match: MessageMatch | None = None,
              forced_text: ForcedText | None = None
              ) -> tuple[list[int], list[str], list[torch.Tensor | None], list[float | None]]:
        """Draft up to k tokens after `context` (plus the grammar-forced runs after each).

        With `SpecConfig.adaptive`, each proposal must pay for its verification rows
        (`AdaptiveLength.pays`), else the chain ends before it.

        Args:
            context: [N] int64 array (or list), the full token sequence so far (cached and to-be-fed).
            matcher: llguidance matcher or None; left in the state it had on entry.
            allowed: callable(matcher) -> bool [V] mask (for the draft model's proposals).
            budget: most chain tokens in total.
            temperature: 0 -> the draft model proposes its argmax; > 0 it samples (with
                `generator`) and returns q.
            source: the output's copy source (`copy_source`) for prompt lookup; None: plain
                latest-match lookup.
            n_fed: tokens the verification forward carries before the chain (the feed).
            match: a `MessageMatch` for grammar enumerations (with a matcher), or None.
            forced_text: a `ForcedText` (with a matcher), or None.
        Returns:
            (tokens, sources, q, confidence): sources[i] in {"canonical", "lookup", "model", "grammar"};
            q[i] the draft distribution [V] for sampled model proposals, else None (a
            deterministic proposal); confidence[i] the draft model's top probability for its
            proposals, 1.0 for lookup, None for grammar-forced tokens.
        """
        tokens: list[int] = []
        sources: list[str] = []
        qs: list[torch.Tensor | None] = []
        confs: list[float | None] = []
        sources_on = [s for s, on in ((LOOKUP, self.lookup), (MODEL, self.draft),
                                      (CANONICAL, forced_text if matcher is not None else None)) if on is not None]
        if k <= 0 or budget <= 0 or not sources_on:
            return tokens, sources, qs, confs
        adaptive = self.config.adaptive
        ctx = np.asarray(context, dtype=np.int64)  # no copy for an int64 array
        drafted = consumed = 0
        p_all = 1.0  # estimated probability that every proposal so far is accepted
        best = max(self.length.estimate(s) for s in sources_on)  # a proposal's best-case estimate
        # When not even the likeliest proposal pays, the step does not draft, except for a
        # periodic one-token probe that keeps the acceptance estimates current.
        probe = adaptive and not self.length.pays(best, n_fed, n_fed + 1) and self.length.probe()
        while drafted < k and len(tokens) < budget:
            rows = n_fed + len(tokens)
            if adaptive and not probe and not self.length.pays(p_all * best, rows, rows + 1):
                break  # not even the likeliest proposal would pay for its row: do not draft
            full = np.concatenate([ctx, np.asarray(tokens, dtype=np.int64)]) if tokens else ctx
            tok, src, q, conf = self._propose(full, matcher, allowed, temperature, generator, source, match,
                                              forced_text)
            if tok is None:
                break
            forced = self._forced_after(tok, matcher, jump_forward, budget - len(tokens) - 1)
            n_this = 0 if matcher is None else 1 + len(forced)  # tokens the matcher consumed
            est = self.length.estimate(src, conf)
            if adaptive and not probe and not self.length.pays(p_all * est, rows, rows + 1 + len(forced)):
                if n_this:
                    matcher.rollback(n_this)
                break
            consumed += n_this
            p_all *= est
            tokens += [tok, *forced]
            sources += [src] + [GRAMMAR] * len(forced)
            qs += [q] + [None] * len(forced)
            confs += [conf] + [None] * len(forced)
            drafted += 1
            if probe or (matcher is not None and matcher.is_stopped()):
                break
        if matcher is not None and consumed:
            matcher.rollback(consumed)
        return tokens, sources, qs, confs

    def guess(self, context: np.ndarray, matcher, allowed, source: tuple[int, int] | None = None,
              match: MessageMatch | None = None, forced_text: ForcedText | None = None) -> int | None:
        """The drafters' greedy proposal for the token after `context` [N] int64, whether or not it
        would pay for a verification row (the guess of pipelined drafting, `tokenspeed.decode`), or
        None when no drafter proposes one. Arguments as `chain`; the matcher is not advanced."""
        return self._propose(np.asarray(context, dtype=np.int64), matcher, allowed, 0.0, None, source, match,
                             forced_text)[0]

    def _copy(self, full: np.ndarray, matcher, allowed, source, match: MessageMatch | None,
              forced_text: ForcedText | None) -> tuple[int | None, str, bool]:
        """A copied proposal after `full` [N] int64: (token or None, its source, whether it is from
        the last message or canonical forced text, which no other drafter may override).

        A copy from the last message (an n-gram continuation there, or the enumeration value it
        names) comes before the draft model: agents copy names and numbers from the request.
        """
        looked = forced_text.propose(matcher) if forced_text is not None and matcher is not None else None
        if looked is not None:
            return looked, CANONICAL, True  # canonical forced text: no other drafter is asked
        from_msg = False
        if self.lookup is not None:
            for cand, in_msg in itertools.islice(self.lookup.candidates(full, source), 16):
                if matcher is None or matcher.validate_tokens([cand]) == 1:
                    looked, from_msg = cand, in_msg
                    break
                if in_msg:  # the copied value ends here (e.g. a number's last digit): no older copy
                    break
        if not from_msg and match is not None and matcher is not None:
            named = match.propose(allowed(matcher))
            if named is not None:
                looked, from_msg = named, True
        return looked, LOOKUP, from_msg

    def _propose(self, full: np.ndarray, matcher, allowed, temperature: float, generator, source,
                 match: MessageMatch | None, forced_text: ForcedText | None
                 ) -> tuple[int | None, str, torch.Tensor | None, float]:
        """The next chain proposal after `full`: (token, source, q [V] or None, confidence); token
        None ends the chain (nothing to propose, or an unsure draft model with no copy)."""
        looked, src, from_msg = self._copy(full, matcher, allowed, source, match, forced_text)
        if self.draft is None or from_msg or not self.length.model_on():
            return looked, src, None, 1.0
        t_model = time.perf_counter()
        logits = self.draft.logits(full)  # [Vd] fp32, or None (context beyond the draft's KV)
        self.model_calls, self.model_s = self.model_calls + 1, self.model_s + time.perf_counter() - t_model
        if logits is None:
            return looked, src, None, 1.0
        vocab = self.draft.draft.vocab
        if matcher is not None:
            logits = logits.masked_fill(~to_device(allowed(matcher), logits.device)[vocab], float("-inf"))
        probs = torch.softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        top, pick = probs.max(-1)
        if temperature > 0:  # drawn before the read (from all-NaN probabilities: a placeholder, never used)
            pick = torch.multinomial(torch.nan_to_num(probs, nan=1.0), 1, generator=generator)[0]
        top, pick = torch.stack([top, pick.to(top.dtype)]).tolist()  # the draft's one host read per proposal
        if math.isnan(top):  # the grammar allows none of the draft's vocabulary (softmax of all -inf)
            return looked, src, None, 1.0
        # The model's proposal wins unless it is unsure and the context offers a copy; alone, it
        # must be confident enough to be worth a verification row.
        if looked is None and top < self.config.min_confidence:
            return None, src, None, 1.0
        if looked is not None and top < self.config.lookup_below:
            return looked, src, None, 1.0
        q = None
        if temperature > 0:
            q = torch.zeros(self.draft.draft.net.tok_embeddings.num_embeddings, device=probs.device)
            q[vocab] = probs
        return self.draft.draft.vocab_ids[int(pick)], MODEL, q, top

    @staticmethod
    def _forced_after(tok: int, matcher, jump_forward: bool, room: int) -> list[int]:
        """Consume `tok` in the matcher and the grammar-forced run after it (at most `room`
        tokens); returns that run. No matcher: nothing is consumed or forced."""
        if matcher is None:
            return []
        matcher.consume_token(tok)
        if jump_forward and not matcher.is_stopped():
            forced = matcher.compute_ff_tokens()[: max(room, 0)]
            if forced and matcher.consume_tokens(forced):
                return forced
        return []

    def record(self, n_tokens: int, forward_s: float, proposals: list[tuple[str, float, bool]], draft_s: float,
               discarded: int) -> None:
        """Account one verification (`AdaptiveLength.record`) with the draft-model calls made for it."""
        self.length.record(n_tokens, forward_s, proposals, draft_s, self.model_calls, self.model_s, discarded)
        self.model_calls, self.model_s = 0, 0.0
