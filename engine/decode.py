"""The decode loop of `Session.decide()` and `Session.generate()`: jump-forward, draft, verify, accept.

Each step appends the tokens the grammar forces (jump-forward, no model), lets the speculator draft
a chain, runs the target once over [fed tokens, chain], keeps the accepted prefix (greedy: equal to
the target's masked argmax; sampling: speculative rejection sampling, Leviathan et al. 2023, alg. 1;
Chen et al. 2023) and discards the rest. With no drafter a step is plain decoding, so greedy output
is token-for-token the plain greedy output. The loop sees the model only through `Target`.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import numpy as np
import torch

from .device import to_device
from .quant import linear_rows
from .speculation import ForcedText, MessageMatch, Speculator, copy_source
from .speculation.drafters import GRAMMAR

__all__ = ["Target", "DecodeStats", "NonFiniteLogitsError", "decode", "token_probs", "PREFILL_CHUNK",
           "LM_HEAD_ROWS"]

HostResult = TypeVar("HostResult")
PREFILL_CHUNK = 512  # tokens per prefill forward: bounds the attention mask and activations
LM_HEAD_ROWS = 4096  # grammar allows at most this many ids next -> project only those lm_head rows
MAX_VERIFY = 512     # most tokens one verification forward carries


class NonFiniteLogitsError(ArithmeticError):
    """A forward produced NaN or infinite logits (corrupt weights or an overflow): the decision
    is answered "invalid", never "ok"."""


class Target:
    """The target model over one session's KV cache and token ids: all the decode loop asks of it.

    Every tensor it makes lives on the model's device (`device`); the token ids stay on the host.

    Attributes:
        model: the `Transformer`.
        cache: its KV cache (`tokenspeed.model.KVCache` or `tokenspeed.kv.TieredKVCache`).
        tokens: token ids whose KV is in the cache, in slot order (an int64 `array.array`: `context()`
            reads it as numpy with one copy, not one conversion per id, however long the session runs).
        mask: the session's `TokenMask` (grammar masks, applied on the device), or None.
        device: the model's device.
        graphs: the `tokenspeed.device.DecodeGraphs` that runs decode and verification forwards
            (CUDA graphs), or None: the model's own forward runs them (the CPU: its fused step).
        worker: a one-thread `concurrent.futures.Executor` that runs the host's work beside a CPU
            forward (`forward_beside`, `Engine.host_worker`), or None.
        pipelined: decode steps draft the next chain while their forward runs (`Engine.pipeline`).
    """

    def __init__(self, model, cache, mask=None, graphs=None, worker=None, pipelined=False):
        self.model, self.cache, self.mask, self.graphs, self.worker = model, cache, mask, graphs, worker
        self.pipelined = pipelined
        self.device = model.device
        self.tokens = array("q")

    def forward_beside(self, ids: list[int], rows, head_rows: torch.Tensor | None, host: Callable[[], HostResult]
                       ) -> tuple[torch.Tensor | None, HostResult, bool]:
        """`forward(ids, rows, head_rows)` and `host()` at the same time, where this target can.

        On CUDA `host` runs on the caller's thread while the queued kernels run. With a `worker`
        (the CPU, pipelined) `host` runs on the worker thread, with the caller's torch intra-op
        thread count, while the forward runs on the caller's (the fused decode step releases the
        GIL), so that no thread hand-off stands between the forward and its result. Otherwise
        `host` runs after the forward. `host` must not touch the cache or the token ids.

        Returns:
            (the forward's result, host's result, whether they overlapped).
        Raises:
            what the forward raises (after `host` has finished), else what `host` raises.
        """
        if self.worker is None:
            out = self.forward(ids, rows, head_rows)
            return out, host(), self.device.type != "cpu"
        threads = torch.get_num_threads()  # per thread in torch: the worker follows the caller's setting

        def run():
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            return host()

        job = self.worker.submit(run)
        try:
            out = self.forward(ids, rows, head_rows)
        except BaseException:
            wait([job])
            raise
        return out, job.result(), True

    def context(self, feed=()) -> np.ndarray:
        """The cached token ids then `feed` (ids not yet cached): [N + len(feed)] int64, a copy."""
        return np.concatenate([np.frombuffer(self.tokens, dtype=np.int64), np.asarray(feed, dtype=np.int64)])

    def forward(self, ids: list[int], rows="last", head_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Append `ids` to the cache at the next positions (in chunks of `PREFILL_CHUNK`).

        Args:
            ids: new token ids.
            rows: which rows of the last chunk get logits: "last" -> [1, V], "all" -> [T, V], an
                int64 index tensor [K] on the model's device -> [K, V], "none" -> None (prefill).
            head_rows: [K] int64 (host) vocabulary ids: a single-row forward projects only these
                lm_head rows (the ids a grammar allows; the other logits stay -inf). None: all.
        Returns:
            fp32 logits as above, on the model's device (on CUDA the forward may still be running).
        Raises:
            ValueError: the cache has no room.
        """
        pos0 = self.cache.next_position()
        if self.graphs is not None and self.graphs.applies(len(ids), pos0):
            return self._graph_forward(ids, pos0, rows, head_rows)
        out = None
        for i in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[i:i + PREFILL_CHUNK]
            last = i + PREFILL_CHUNK >= len(ids)
            out = self.model(to_device(chunk, self.device), pos0 + i, self.cache, rows if last else "none",
                             head=head_rows is None)
        self.tokens.extend(ids)
        return out if head_rows is None else self._project(out, head_rows)

    def _project(self, h: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
        # hidden [1, dim] -> logits [1, V] of the allowed ids `head_rows` (host) only, -inf elsewhere
        head_rows = to_device(head_rows, self.device)
        logits = torch.full((1, self.model.args.vocab_size), float("-inf"), device=self.device)
        logits[:, head_rows] = linear_rows(self.model.output, h, head_rows)
        return logits

    def _graph_forward(self, ids: list[int], pos0: int, rows, head_rows: torch.Tensor | None) -> torch.Tensor | None:
        # `forward` through the decode graphs: they return the final hidden states of every row
        h = self.graphs.run(ids, pos0)  # [len(ids), dim]
        self.tokens.extend(ids)
        if isinstance(rows, str):
            if rows == "none":
                return None
            h = h[-1:] if rows == "last" else h
        else:
            h = h[rows]
        return self.model.output(h).float() if head_rows is None else self._project(h, head_rows)

    def discard(self, n: int) -> None:
        """Drop the KV and token ids of the last n cached tokens (rejected draft tokens)."""
        if n:
            self.cache.truncate(self.cache.n - n)
            del self.tokens[len(self.tokens) - n:]


@dataclass
class DecodeStats:
    """What one `decode` call did (the `Decision` fields of the same names).

    Attributes: ttft_s (start -> first chosen token, seconds), itl_s (seconds per token, amortised
    over a step's tokens), forwards, forced_tokens, generated_tokens, draft_tokens,
    accepted_tokens, draft_sources ({source: [proposed, accepted]}), drafted_ahead (steps whose
    chain was drafted during the previous step's forward), p_call (tool_choice "auto": the first
    position's p(call), `AutoRule.apply`; else None), deadline_missed (bool), reason (why the
    answer ended early, or "").
    """

    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    forwards: int = 0
    forced_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_sources: dict = field(default_factory=dict)
    drafted_ahead: int = 0
    p_call: float | None = None
    deadline_missed: bool = False
    reason: str = ""

    def counters(self) -> dict:
        """The timings and token counts, as `Decision` keyword arguments."""
        out = asdict(self)
        del out["deadline_missed"], out["reason"]
        return out


def decode(target: Target, speculator: Speculator, feed: list[int], *, tok=None, matcher=None,
           jump_forward: bool = True, max_tokens: int = 256, deadline_at: float | None = None,
           temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
           t0: float | None = None, on_token=None, auto=None, force=None) -> tuple[list[int], list[int], DecodeStats]:
    """Decode one answer: speculative when `speculator` has drafters, plain otherwise.

    Args:
        target: the `Target` (its cache and token ids advance by what is accepted).
        speculator: the session's `Speculator`.
        feed: tokens to feed before the first decision (not yet in the KV cache).
        tok: the `Tokenizer` (stop ids, copy sources), or None (no stop tokens, no copies).
        matcher: llguidance matcher (grammar; needs `target.mask`) or None (free text).
        jump_forward: append grammar-forced tokens without sampling them.
        max_tokens: most output tokens (forced ones included).
        deadline_at: absolute `time.monotonic()` deadline, or None.
        temperature, top_p, generator: sampling (temperature 0: greedy).
        t0: `time.perf_counter()` at the call's start (for ttft_s).
        on_token: callback(list[int]) receiving the output ids after each step; True ends the answer.
        auto: the `tokenspeed.auto.AutoRule` that settles call or text at the first position
            (tool_choice "auto"; that step drafts nothing), or None.
        force: callback(list[int]) receiving the output ids after each step and returning ids to
            append next without the model (e.g. the quote that ends a string in a loop); they are
            appended only when the grammar accepts them all and max_tokens leaves room. None: none.
    Returns:
        (out, feed, stats): the output ids (stop token excluded), the last chosen token(s) not yet
        in the KV cache, and the counters.
    Raises:
        NonFiniteLogitsError: a forward produced NaN/inf logits.
    """
    stats = DecodeStats()
    t0 = time.perf_counter() if t0 is None else t0
    stop_ids = set(tok.stop_ids) if tok is not None else set()
    copying = _copy_helpers(target.context(feed), speculator, tok, matcher, stop_ids)
    out: list[int] = []
    t_last = None
    ahead = None  # the next step's chain, drafted during this step's forward (`_draft_ahead`)
    while True:
        if matcher is not None:
            if jump_forward:
                feed = feed + _jump_forward(matcher, out, stats, max_tokens)
            if matcher.is_stopped():
                break
        if _ends_before_step(stats, len(out), deadline_at, max_tokens):
            break
        feed, stop, emitted, now, ahead = _step(target, speculator, feed, out, stats, copying, matcher, jump_forward,
                                                max_tokens, temperature, top_p, generator, stop_ids, ahead,
                                                auto if stats.forwards == 0 else None)
        if emitted:
            if t_last is None:
                stats.ttft_s = now - t0
            else:  # amortised: a step that emits several tokens spreads its time over them
                stats.itl_s.extend([(now - t_last) / emitted] * emitted)
            t_last = now
        if on_token is not None and on_token(out):
            stop = True  # the caller ends the answer here (a stop sequence)
        if stop or (matcher is None and len(out) >= max_tokens):
            break
        if force is not None and matcher is not None:
            feed = feed + _force(matcher, force(out)[:max(max_tokens - len(out), 0)], out, stats)
    return out, feed, stats


def _copy_helpers(context: np.ndarray, speculator: Speculator, tok, matcher, stop_ids: set[int]):
    """(copy source, MessageMatch or None, ForcedText or None) for this answer's drafting."""
    source = copy_source(context, len(context), stop_ids) if speculator.lookup else None
    match = None
    if source is not None and matcher is not None and tok is not None:
        texts = speculator.token_texts

        def token_text(i: int) -> str:
            if i not in texts:
                texts[i] = tok.decode([i])
            return texts[i]

        match = MessageMatch(tok.decode(context[source[0]:source[1]].tolist(), skip_special=True), token_text)
    forced_text = ForcedText(tok.encode) if speculator.forced_text and matcher is not None and tok is not None else None
    return source, match, forced_text


def _jump_forward(matcher, out: list[int], stats: DecodeStats, max_tokens: int) -> list[int]:
    """Consume the tokens the grammar forces now, as many as `max_tokens` leaves room for; they
    join the output and the next feed."""
    forced = matcher.compute_ff_tokens()[:max(max_tokens - len(out), 0)]
    if forced and matcher.consume_tokens(forced):
        out.extend(forced)
        stats.forced_tokens += len(forced)
        return forced
    return []


def _force(matcher, ids: list[int], out: list[int], stats: DecodeStats) -> list[int]:
    """Consume `ids` when the grammar accepts them all; they join the output and the next feed."""
    if ids and matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids):
        out.extend(ids)
        stats.forced_tokens += len(ids)
        return ids
    return []


def _ends_before_step(stats: DecodeStats, n_out: int, deadline_at: float | None, max_tokens: int) -> bool:
    """Whether the deadline or the token budget ends the answer before the next step (reason set)."""
    if deadline_at is not None and time.monotonic() >= deadline_at:
        stats.deadline_missed, stats.reason = True, f"deadline passed after {n_out} tokens"
        return True
    if n_out >= max_tokens:
        stats.reason = f"no complete call within max_tokens={max_tokens}"
        return True
    return False


@dataclass
class _Ahead:
    """A chain drafted during the previous step's forward (`_draft_ahead`): usable when the
    cached tokens number `n_cached` and the step's feed is `feed` (then the context and the
    grammar state are the ones it was drafted for)."""

    n_cached: int
    feed: list[int]
    chain: tuple  # `Speculator.chain`'s (tokens, sources, q, confidence)


def _step(target: Target, spec: Speculator, feed: list[int], out: list[int], stats: DecodeStats, copying,
          matcher, jump_forward: bool, max_tokens: int, temperature: float, top_p: float, generator,
          stop_ids: set[int], ahead: _Ahead | None, auto=None) -> tuple[list[int], bool, int, float, _Ahead | None]:
    """Draft (or take the chain drafted ahead), verify in one forward, accept; returns (next feed,
    stop, tokens emitted, the `time.perf_counter()` when they were chosen, the next step's chain
    drafted during this forward or None). With `auto` (an `AutoRule`) nothing is drafted and the
    rule settles the first token's branch."""
    source, match, forced_text = copying
    t_draft = time.perf_counter()
    allowed = target.mask.allowed if matcher is not None else None
    context = target.context(feed)
    budget = max_tokens - len(out) - 1
    if ahead is not None and ahead.n_cached == len(target.tokens) and ahead.feed == feed:
        chain, sources, qs, confs = ahead.chain
        stats.drafted_ahead += 1
    else:
        chain, sources, qs, confs = spec.chain(context, 0 if auto is not None else spec.max_k, matcher, allowed,
                                               jump_forward, budget, temperature, generator, source, len(feed), match,
                                               forced_text)
    t_draft = time.perf_counter() - t_draft
    if len(feed) + len(chain) > MAX_VERIFY:  # keep the verified rows in one forward
        target.forward(feed[:-1], "none")
        feed = feed[-1:]
    ids = feed + chain
    # Logits only where a token is chosen: the proposals' rows and the last row (a grammar-forced
    # token needs none). Row r of the chain is predicted by ids[len(feed) - 1 + r].
    choose = [r for r in range(len(chain) + 1) if r == len(chain) or sources[r] != GRAMMAR]
    select = to_device(choose, target.device)
    t_fwd = time.perf_counter()
    # A plain step's mask comes first: a grammar that allows few ids projects only those lm_head
    # rows (vocab x dim is a large share of the model's bytes per token).
    masks = target.mask.fill_chain(matcher, []) if matcher is not None and not chain else None
    head_rows = _head_rows(target.mask, masks)
    # Pipelining: while the forward runs (CUDA: queued kernels; CPU: beside it on the worker thread,
    # else after it), the host computes what does not depend on its result: the grammar masks of
    # every row of the chain and, pipelined, the next step's chain for the case that all of this
    # chain is accepted (greedy only).
    pipelined = target.pipelined and spec.enabled and temperature <= 0
    full = np.concatenate([context, np.asarray(chain, dtype=np.int64)]) if pipelined else None

    def host():
        t = time.perf_counter()
        rows = target.mask.fill_chain(matcher, chain) if matcher is not None and masks is None else masks
        nxt = _draft_ahead(spec, full, chain, matcher, allowed, jump_forward, budget - len(chain),
                           copying) if pipelined else None
        return rows, nxt, time.perf_counter() - t

    logits, (masks, ahead, t_host), overlapped = target.forward_beside(ids, select + (len(feed) - 1), head_rows,
                                                                       host)  # logits [len(choose), V]
    # logits projected on the allowed ids only are already masked (-inf elsewhere)
    drafts = [(chain[r], qs[r]) if r < len(chain) else (None, None) for r in choose]
    if auto is not None:  # one row: grammar-masked here, then the rule keeps one branch
        if masks is not None and head_rows is None:
            target.mask.apply(logits, masks, select)
        masks = None
        stats.p_call = auto.apply(logits)
    picks = _choices(logits, masks if head_rows is None else None, select, target.mask, drafts, temperature, top_p,
                     generator, len(ids))
    # The forward's time: start to choice, less the host work that ran after it (not overlapped).
    t_fwd = time.perf_counter() - t_fwd - (0.0 if overlapped else t_host)
    stats.forwards += 1
    next_feed, stop, emitted, row, proposals = _accept(chain, sources, confs, dict(zip(choose, picks)), out, stats,
                                                       matcher, jump_forward, max_tokens, stop_ids)
    chosen_at = time.perf_counter()
    # The KV keeps the fed tokens and chain[:row], the accepted prefix.
    target.discard(len(chain) - row)
    if spec.enabled:
        spec.record(len(ids), t_fwd, proposals, t_draft, len(chain) - row)
    return next_feed, stop, emitted, chosen_at, ahead


def _draft_ahead(spec: Speculator, full: np.ndarray, chain: list[int], matcher, allowed, jump_forward: bool,
                 budget: int, copying) -> _Ahead | None:
    """Draft the next step's chain while this step's forward runs (pipelined drafting: PEARL's
    "post-verify", Liu et al. 2024): assume the target accepts all of `chain` and then
    chooses the drafters' own next proposal (the guess), followed by the grammar-forced run after
    it (what the next step's jump-forward feeds), and draft after that.

    Args:
        full: [N] int64, the context through `chain` (cached, fed and drafted tokens).
        chain: this step's chain (the matcher has not consumed it).
        budget: most output tokens after `chain` (the guess and the next chain included).
        copying: `_copy_helpers`' (copy source, MessageMatch, ForcedText).
    Returns:
        the `_Ahead`, or None (no guess, or the answer would end before the next step). The
        matcher is left as it was; the draft model's KV follows the guessed context (a wrong
        guess costs the next step's draft a re-sync of the differing tokens).
    """
    source, match, forced_text = copying
    consumed = 0
    try:
        if matcher is not None:
            if chain and not matcher.consume_tokens(chain):
                return None
            consumed = len(chain)
            if matcher.is_stopped():
                return None
        guess = spec.guess(full, matcher, allowed, source, match, forced_text)
        if guess is None:
            return None
        feed = [guess]
        if matcher is not None:
            if not matcher.consume_token(guess):
                return None
            consumed += 1
            if jump_forward and not matcher.is_stopped():
                forced = matcher.compute_ff_tokens()
                if forced and matcher.consume_tokens(forced):
                    feed += forced
                    consumed += len(forced)
            if matcher.is_stopped():
                return None
        nxt = spec.chain(np.concatenate([full, np.asarray(feed, dtype=np.int64)]), spec.max_k, matcher, allowed,
                         jump_forward, budget - len(feed), 0.0, None, source, len(feed), match, forced_text)
        return _Ahead(len(full), feed, nxt)
    finally:
        if consumed:
            matcher.rollback(consumed)


def _head_rows(mask, masks: torch.Tensor | None) -> torch.Tensor | None:
    """The allowed ids [K] int64 (host) of a plain step's mask [1, n_words] when there are at most
    `LM_HEAD_ROWS` of them (only those lm_head rows are projected), else None."""
    if masks is None:
        return None
    allowed = mask.unpacked(masks[0]).nonzero().flatten()
    return allowed if 0 < len(allowed) <= LM_HEAD_ROWS else None


def _choices(logits: torch.Tensor, masks: torch.Tensor | None, select: torch.Tensor, mask, drafts: list,
             temperature: float, top_p: float, generator: torch.Generator | None, n_tokens: int) -> list[int]:
    """Mask the verified rows' logits [R, V] in place on the device (rows `select` [R] of the
    chain's `masks`, or no grammar) and choose the target's token of each row: [R] token ids.

    Greedy: the masked argmax. Sampling (`temperature` > 0, `top_p`, `generator` on the logits'
    device): speculative rejection sampling (Leviathan et al. 2023, alg. 1; Chen et al. 2023), for
    every row at once. Row r's proposal x with draft distribution q (drafts[r] = (x, q [V] or
    None: deterministic, q one-hot) or (None, None): no proposal) is kept with probability
    min(1, p(x) / q(x)); otherwise the token is sampled from norm(max(p - q, 0)) (from p with no
    proposal). A row's proposal is accepted iff its chosen token equals it.

    Raises:
        NonFiniteLogitsError: NaN or +inf logits, or a row with no finite logit.
    """
    chosen, finite = _choose_rows(logits, masks, select, mask, drafts, temperature, top_p, generator)
    # The decode loop's one host read per forward: every row's chosen token and the finiteness flag.
    values = torch.cat([chosen, finite.view(1).long()]).tolist()
    if not values[-1]:
        raise NonFiniteLogitsError(f"non-finite logits in a forward over {n_tokens} tokens")
    return values[:-1]


def _choose_rows(logits: torch.Tensor, masks: torch.Tensor | None, select: torch.Tensor, mask, drafts: list,
                 temperature: float, top_p: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`_choices` on the device, with nothing read on the host: (chosen tokens [R] int64, whether
    the logits are finite [] bool)."""
    # no NaN, no +inf, and some finite logit in every row (before the grammar masks)
    finite = ~(logits.isnan().any() | logits.isposinf().any()) & (logits.amax(-1) > float("-inf")).all()
    if masks is not None:
        mask.apply(logits, masks, select)
    if temperature <= 0:
        return logits.argmax(-1), finite
    return _sample_rows(logits, drafts, finite, temperature, top_p, generator), finite


def _sample_rows(logits: torch.Tensor, drafts: list, finite: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> torch.Tensor:
    """`_choices`' sampled tokens [R] int64 on the device from the masked logits [R, V] (when
    `finite` [] bool is False the draws are meaningless, and never read)."""
    p = token_probs(logits, temperature, top_p)                                    # [R, V]
    x = to_device(torch.tensor([-1 if d[0] is None else d[0] for d in drafts], device="cpu"), p.device)
    xi = x.clamp(min=0).unsqueeze(1)                                               # [R, 1]
    q = torch.zeros_like(p)  # draft distributions: sampled, one-hot (deterministic), none (no proposal)
    for r, (proposal, qr) in enumerate(drafts):
        if qr is not None:
            q[r] = qr
        elif proposal is not None:
            q[r, proposal] = 1.0
    u = torch.rand(x.shape[0], generator=generator, device=p.device)
    accept = (x >= 0) & (u * q.gather(1, xi)[:, 0] < p.gather(1, xi)[:, 0])
    residual = (p - q).clamp_min(0.0)  # p itself where there is no proposal
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    residual = torch.where(finite, residual, torch.ones_like(residual))  # NaN must not reach multinomial
    return torch.where(accept, x, torch.multinomial(residual, 1, generator=generator)[:, 0])


def _accept(chain, sources, confs, picks: dict, out: list[int], stats: DecodeStats, matcher,
            jump_forward: bool, max_tokens: int, stop_ids: set[int]):
    """Walk the verified rows (chain row -> the target's chosen token, `_choices`): accept
    proposals while the target agrees, take its own token at the first disagreement (or after the
    chain). Returns (next feed, stop, emitted, last row, proposals as (source, confidence,
    accepted)). The walk always ends at some row: the last has no proposal."""
    proposals: list[tuple[str, float, bool]] = []
    emitted = row = 0
    for row in range(len(chain) + 1):
        src = sources[row] if row < len(chain) else None
        if src == GRAMMAR:  # forced after an accepted token: plain decoding forces it too
            matcher.consume_token(chain[row])
            out.append(chain[row])
            stats.forced_tokens += 1
            continue
        if src is not None:
            stats.draft_tokens += 1
            stats.draft_sources.setdefault(src, [0, 0])[0] += 1
        if matcher is not None and row == len(chain) and (
                matcher.is_stopped() or (jump_forward and matcher.compute_ff_tokens())):
            break  # the call is complete, or the chain was cut inside a forced run (forced next step)
        token = picks[row]
        ok = src is not None and token == chain[row]
        if src is not None:
            proposals.append((src, confs[row], ok))
        if ok:
            stats.accepted_tokens += 1
            stats.draft_sources[src][1] += 1
        stats.generated_tokens += 1
        emitted += 1
        if token in stop_ids and (matcher is None or matcher.is_accepting()):
            return [], True, emitted, row, proposals
        if matcher is not None and not matcher.consume_token(token):
            stats.reason = f"grammar rejected token {token}: {matcher.get_error()}"
            return [], True, emitted, row, proposals
        out.append(token)
        if not ok or (matcher is None and len(out) >= max_tokens):
            return [token], False, emitted, row, proposals  # chosen, not yet in the KV cache
    return [], False, emitted, row, proposals


def token_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distributions [..., V] (fp32) from logits [..., V]: softmax(logits / temperature),
    top-p filtered.

    Top-p (Holtzman et al., 2020) keeps the smallest set of most likely tokens whose mass reaches
    `top_p` and renormalises. Masked (-inf) logits get probability 0.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
        probs /= probs.sum(-1, keepdim=True)
    return probs
