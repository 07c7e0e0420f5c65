"""Speculative decoding: drafters propose a chain of tokens, the target verifies it in one forward.

One decode loop (`decode`) serves `Session.decide()` (grammar-constrained, greedy) and
`Session.generate()` (free text, greedy or sampled). Every step it

1. appends the tokens the tool-call grammar forces (jump-forward, no model),
2. asks the drafters for a chain of up to k proposed tokens, interleaved with the grammar-forced
   runs that follow each proposed token (those need no verification: plain decoding forces them
   too), and checks each proposal against the grammar before it costs a forward,
3. runs the target once over [last token, chain] (logits only for the rows where a token is
   chosen: a grammar-forced row needs none) and walks the
   rows: greedy keeps the longest prefix equal to the target's (grammar-masked) argmax;
   sampling uses speculative rejection sampling (Leviathan et al. 2023, "Fast Inference from
   Transformers via Speculative Decoding", alg. 1; Chen et al. 2023, "Accelerating Large
   Language Model Decoding with Speculative Sampling"), which preserves the target's
   distribution exactly,
4. discards the rejected tokens' KV (`KVCache.truncate`) and rolls the grammar matcher back.

With no drafter (or k = 0) a step is exactly plain decoding, so greedy speculative output is
token-for-token the plain greedy output.

Drafters (combined as a single chain, not a tree: the target's forward verifies new tokens
causally, so a tree would need a tree attention mask in the model; on CPU a forward's cost also
grows with the tokens it verifies, and in tool calls most tokens are grammar-forced, leaving few
decided positions for branches to pay off. `tokenspeed draft eval --verify-cost` times the
target forward against the number of verified tokens):

- `PromptLookup`: n-gram match of the context's tail against earlier context (Saxena 2023,
  "Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding). Agents copy object
  names, ids and numbers from observations into arguments, in order: matches before the output
  are tried oldest first, skipping values the output already copied; the first candidate the
  grammar accepts is proposed.
- `MessageMatch`: where the grammar allows only a few tokens (a tool name, an enum value), the
  allowed token the last message names ("Place the cube ..." -> "place").
- `DraftModel`: a small co-located Llama that lives next to the target, shares its tokenizer and
  its (frozen) token embeddings, and predicts over a reduced vocabulary whose output rows are the
  target's own lm_head rows (a frequency-ranked draft vocabulary as in EAGLE-3, Li et al. 2025,
  and FR-Spec, Zhao et al. 2025). It is trained by self-distillation on the target's own tool
  calls (DistillSpec, Zhou et al. 2024; recipe in `tokenspeed.draft`). Its KV cache follows the
  session's token sequence: before drafting it keeps the longest common prefix and prefills the
  rest, so observe/rollback/pruning of the session need no hooks.
- Grammar runs: llguidance's forced tokens (`compute_ff_tokens`) after each drafted token.
- `ForcedText`: where the grammar forces bytes but not yet a token (`compute_ff_bytes`: the
  bytes ': "' before a string value may start the token ' "' or ' ' then '"', or merge with the
  value), the first token of the forced text's canonical tokenization (' "'). The target keeps
  to canonical tokenization, so these are accepted almost always, where the draft model had
  been guessing.

Per position the canonical token of forced text is proposed first; then a copy from the last
message (a prompt-lookup candidate there, or a `MessageMatch`) - on the AAL turns copies first
raised acceptance from 22% to ~50% - else the draft model proposes; an older prompt-lookup match replaces its proposal only when the model is unsure
(`SpecConfig.lookup_below`), and with no match an unsure model ends the chain
(`SpecConfig.min_confidence`); without a draft model, prompt lookup alone proposes. Every
proposal is checked against the grammar before it enters the chain.

`AdaptiveLength` decides per proposal whether it pays: the forward overhead it saves when accepted
(estimated acceptance: the draft's calibrated confidence, or lookup's running rate) against the
rows it wastes when rejected (itself and the grammar-forced run it drags along), from measured
forward times; when nothing pays, a step is plain decoding. The draft model as a whole is
called only while its calls save more than they cost (`AdaptiveLength.model_on`).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .model import KVCache, ModelArgs, Transformer

__all__ = ["SpecConfig", "PromptLookup", "MessageMatch", "ForcedText", "copy_source", "DraftModel", "DraftState",
           "AdaptiveLength", "Speculator", "decode", "token_probs", "DEFAULT_DRAFT"]

DEFAULT_DRAFT = Path(__file__).parent / "data" / "draft-smollm2-135m.safetensors"
GRAMMAR, LOOKUP, MODEL, CANONICAL = "grammar", "lookup", "model", "canonical"


def token_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution [V] (fp32) from logits [V]: softmax(logits / temperature), top-p filtered.

    Top-p (Holtzman et al., 2020) keeps the smallest set of most likely tokens whose mass reaches
    `top_p` and renormalises. Masked (-inf) logits get probability 0.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        probs /= probs.sum()
    return probs


# ------------------------------------------------------------------------------------ drafters

class PromptLookup:
    """Propose the token that followed an earlier occurrence of the context's last n-gram.

    Tries n = max_ngram down to min_ngram (longer matches first). Source: Saxena 2023,
    "Prompt Lookup Decoding", which takes the latest occurrence. A tool call copies values from
    its source (the user's request, an observation) in their order, and a short n-gram such as
    "0 ." occurs once per number there, so given the output's `source` (`copy_source`), the
    occurrences in the last message are tried first, then those in the `window` tokens before
    it, each oldest first, skipping those whose proposal the output has already copied (the
    pair (last n-gram token, proposal) occurs in the output). Otherwise (or when all are used)
    the latest occurrence is proposed.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, window: int = 512):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, context: np.ndarray, source: tuple[int, int] | None = None) -> int | None:
        """Next-token proposal for `context` [N] int64, or None when no n-gram matches.

        source: (start of the last message, start of the output) in `context` (`copy_source`);
        None: plain latest-match lookup.
        """
        return next((tok for tok, _ in self.candidates(context, source)), None)

    def candidates(self, context: np.ndarray, source: tuple[int, int] | None = None):
        """All proposals for `context` in preference order (the first is `propose`'s), as
        (token, from_message): longer n-grams first; for each, with a `source`, the copies from
        the last message (from_message True), then from the window before it, then the latest
        occurrence. A caller that checks proposals against a grammar takes the first valid one.
        """
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # [N - n, n]
            hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if not len(hits):
                continue
            if source is not None:
                msg, out_start = source
                out = context[out_start:]
                copied = set(zip(out[:-1].tolist(), out[1:].tolist()))
                for lo, hi, in_msg in ((msg, out_start, True), (out_start - self.window, msg, False)):
                    for h in hits[(hits >= lo) & (hits + n < hi)].tolist():
                        if (int(context[h + n - 1]), int(context[h + n])) not in copied:
                            yield int(context[h + n]), in_msg
            yield int(context[hits[-1] + n]), False


class MessageMatch:
    """Drafter for grammar enumerations: where the tool-call grammar allows only a few tokens (a
    tool name, an enum value such as an object name), propose the allowed token whose text
    occurs earliest in the last message as the start of a word, case-insensitively (the longest
    such token at that place): "Place the cube ..." -> "place", "the green cube" -> "green".

    Args:
        message: the last message's text.
        token_text: token id -> its text (a cache shared across decisions).
        max_allowed: enumerations larger than this are left to the other drafters.
    """

    def __init__(self, message: str, token_text, max_allowed: int = 256):
        self.message, self.token_text, self.max_allowed = message.lower(), token_text, max_allowed

    def propose(self, allowed: torch.Tensor) -> int | None:
        """The proposal for a grammar mask `allowed` [V] bool, or None."""
        ids = allowed.nonzero().flatten()
        if len(ids) > self.max_allowed:
            return None
        best, key = None, None
        for i in ids.tolist():
            text = self.token_text(i).strip().lower()
            if len(text) < 2:
                continue
            m = re.search(r"(?<![a-z0-9_])" + re.escape(text), self.message)
            if m is not None and (key is None or (m.start(), -len(text)) < key):
                best, key = i, (m.start(), -len(text))
        return best


class ForcedText:
    """Drafter for grammar-forced text that is not yet a forced token: propose the first token of
    the canonical tokenization of the bytes the grammar forces next (`LLMatcher.compute_ff_bytes`),
    when the grammar accepts it. llguidance forces tokens only up to where a token boundary is
    certain; the bytes after it (e.g. ' "' before a string value) can still start several tokens.

    Args:
        encode: text -> token ids, the target's tokenizer without special tokens.
    """

    def __init__(self, encode):
        self.encode = encode

    def propose(self, matcher) -> int | None:
        """The proposal after the matcher's current state, or None (no forced bytes, bytes that are
        not whole UTF-8 text, or a token the grammar rejects)."""
        forced = matcher.compute_ff_bytes()
        if not forced:
            return None
        try:
            ids = self.encode(forced.decode("utf-8"))
        except UnicodeDecodeError:
            return None
        return ids[0] if ids and matcher.validate_tokens(ids[:1]) == 1 else None


def copy_source(context, out_start: int, end_ids) -> tuple[int, int]:
    """(start of the last message before the output, out_start): where `PromptLookup` copies from.

    context: token ids; out_start: where the output begins; end_ids: end-of-turn token ids (the
    last message starts after the second-to-last of them before out_start; 0 if none).
    """
    ends = [i for i in range(out_start - 1, -1, -1) if context[i] in end_ids][:2]
    return (ends[1] + 1 if len(ends) == 2 else 0), out_start


class DraftModel(nn.Module):
    """A small Llama drafting for one target model, co-located in the same process and device.

    The draft is a `Transformer` whose token embedding module *is* the target's (shared, frozen)
    and whose output layer is a copy of the target's lm_head rows for a reduced vocabulary
    `vocab` [Vd] int64 (target ids). Only its decoder layers and final norm are trained and saved.

    Attributes:
        net: the draft `Transformer` (logits [.., Vd] in draft-vocabulary order).
        vocab: [Vd] int64 target token ids of the draft's output rows.
        target_id: fingerprint of the target it was built for (see `fingerprint`).
        window: tokens of context the draft was trained to attend over (`DraftState`; sessions
            use it unless their KV budget is smaller), or None for the whole context.
    """

    def __init__(self, target: Transformer, args: ModelArgs, vocab: torch.Tensor):
        super().__init__()
        if args.dim != target.args.dim:
            raise ValueError(f"draft dim {args.dim} must equal the target's {target.args.dim} (shared embeddings)")
        # vocab_size is the draft's output vocabulary; its input embedding is the target's module.
        args = replace(args, vocab_size=len(vocab), tie_embeddings=False, max_seq_len=target.args.max_seq_len)
        p = target.tok_embeddings.weight
        with torch.device("meta"):
            net = Transformer(args)
        net = net.to_empty(device=p.device).to(p.dtype)
        with torch.no_grad():
            for w in net.parameters():  # small random init (loaded or copied later)
                if w.dim() == 1:
                    w.fill_(1.0)
                else:
                    w.normal_(0.0, 0.02)
            head = target.output  # an nn.Linear, or a quantized linear (tokenspeed.quant)
            w = head.dequantized(p.dtype) if hasattr(head, "dequantized") else head.weight
            net.output.weight.copy_(w[vocab.to(p.device)])
        net.tok_embeddings = target.tok_embeddings
        net.output.weight.requires_grad_(False)
        net.tok_embeddings.weight.requires_grad_(False)
        self.net = net
        self.register_buffer("vocab", vocab.to(device=p.device, dtype=torch.long), persistent=False)
        self.target_id = fingerprint(target)
        self.window: int | None = None

    @classmethod
    def init_from_target(cls, target: Transformer, vocab: torch.Tensor, n_layers: int = 1,
                         hidden_dim: int = 768) -> "DraftModel":
        """A fresh draft whose layers start as slices of the target's first layers.

        Args:
            target: the target model.
            vocab: [Vd] int64 target token ids the draft predicts.
            n_layers: draft decoder layers.
            hidden_dim: draft SwiGLU width (<= the target's; the target's first rows are copied).
        """
        t = target.args
        if not 1 <= n_layers <= t.n_layers or not 1 <= hidden_dim <= t.hidden_dim:
            raise ValueError(f"draft needs 1 <= n_layers <= {t.n_layers} and 1 <= hidden_dim <= {t.hidden_dim}")
        draft = cls(target, replace(t, n_layers=n_layers, hidden_dim=hidden_dim), vocab)
        h = hidden_dim
        with torch.no_grad():
            draft.net.norm.copy_(target.norm)
            for src, dst in zip(target.layers, draft.net.layers):
                dst.attention.load_state_dict(src.attention.state_dict())
                dst.attention_norm.copy_(src.attention_norm)
                dst.ffn_norm.copy_(src.ffn_norm)
                gate, up = src.feed_forward.w13.weight.split(t.hidden_dim)
                dst.feed_forward.w13.weight.copy_(torch.cat([gate[:h], up[:h]]))
                dst.feed_forward.w2.weight.copy_(src.feed_forward.w2.weight[:, :h])
        return draft

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The draft's own weights (layers and final norm): what `save` writes."""
        return {k: v for k, v in self.net.state_dict().items()
                if not k.startswith(("tok_embeddings.", "output."))}

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Write the draft (fp16 weights, vocabulary, architecture, target fingerprint) as safetensors.

        extra: JSON-serialisable metadata to store alongside (e.g. training report).
        """
        import os

        from safetensors.torch import save_file

        a = self.net.args
        tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in self.trainable_state().items()}
        tensors["draft.vocab"] = self.vocab.to(torch.int32).cpu()
        meta = {"n_layers": a.n_layers, "hidden_dim": a.hidden_dim, "target": self.target_id,
                "window": self.window, "extra": extra or {}}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.cpu() for k, v in tensors.items()}, str(path), metadata={"tokenspeed_draft": json.dumps(meta)})
        os.chmod(path, 0o644)  # safetensors writes 0600; the draft is shared data

    @classmethod
    def load(cls, path: str | Path, target: Transformer) -> "DraftModel":
        """Load a draft saved by `save` for `target`.

        Raises:
            FileNotFoundError: no such file. ValueError: not a draft file, or built for another target.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"draft model {path} does not exist or is not a file")
        try:
            with safe_open(str(path), "pt") as f:
                raw = (f.metadata() or {}).get("tokenspeed_draft")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
        if raw is None:
            raise ValueError(f"{path} is not a tokenspeed draft (no 'tokenspeed_draft' metadata)")
        try:
            meta = json.loads(raw)
            target_id, n_layers, hidden_dim = meta["target"], int(meta["n_layers"]), int(meta["hidden_dim"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed 'tokenspeed_draft' metadata ({exc})") from exc
        if target_id != fingerprint(target):
            raise ValueError(f"{path} was trained for another target model (fingerprint {target_id})")
        vocab = tensors.pop("draft.vocab", torch.empty(0)).long()
        if vocab.dim() != 1 or len(vocab) == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= target.args.vocab_size:
            raise ValueError(f"{path}: draft.vocab must be target token ids in [0, {target.args.vocab_size})")
        draft = cls(target, replace(target.args, n_layers=n_layers, hidden_dim=hidden_dim), vocab)
        p = target.tok_embeddings.weight
        try:
            missing, unexpected = draft.net.load_state_dict(
                {k: v.to(device=p.device, dtype=p.dtype) for k, v in tensors.items()}, strict=False)
        except RuntimeError as exc:  # shape mismatches
            shape = str(exc).splitlines()[-1].strip()
            raise ValueError(f"{path}: weights do not fit the draft's architecture: {shape}") from exc
        own_missing = [k for k in missing if not k.startswith(("tok_embeddings.", "output."))]
        if own_missing or unexpected:
            raise ValueError(f"{path}: missing {own_missing}, unexpected {unexpected}")
        draft.meta = meta
        draft.window = meta.get("window")
        from .quant import Int4Linear, Int8Linear, quantize

        if any(isinstance(m, (Int4Linear, Int8Linear)) for m in target.modules()):
            # A quantized target: the draft's linears go int8 too. Drafting between the target's
            # forwards reads the draft's weights from DRAM each time (the target evicts them from
            # the caches): 17 MB in fp32 took 2.0 ms per proposal, most of a drafting step.
            quantize(draft.net, "int8")
        return draft.eval()

    def new_state(self, capacity: int, window: int | None = None) -> "DraftState":
        """Per-session drafting state with its own KV cache of `capacity` tokens (see `DraftState`
        for `window`)."""
        return DraftState(self, capacity, window)


def fingerprint(target: Transformer) -> str:
    """Short hash identifying a target model's weights (vocab size, dim, first embedding rows)."""
    w = target.tok_embeddings.weight[:8].detach().to(torch.float16).cpu().numpy().tobytes()
    h = hashlib.sha1(w + f"{target.args.vocab_size}/{target.args.dim}".encode()).hexdigest()
    return h[:16]


class DraftState:
    """A draft model's KV cache for one session, following the session's token sequence.

    `logits(context)` keeps the longest common prefix of what is cached and `context`, prefills
    the rest and returns the draft's logits [Vd] for the token after `context`. `sync(context)`
    does the prefill alone, so it can run when the session prefills an observation instead of
    on the decision's critical path (`Speculator.observe`).

    With a `window` (tokens; pruned sessions pass their KV budget) the draft attends only over the
    context's last `window` to 1.5 `window` tokens: when the context outgrows that, the oldest
    cached tokens are dropped so that `window` remain (a slide: their keys and values are moved,
    not recomputed), so drafting costs stay flat on endless streams while the target's own KV is
    pruned. Rotary attention depends on relative positions only, so for a one-layer draft (whose
    keys and values depend on their own token alone) the slide equals recomputing the window
    from position 0, which is what training sees (`tokenspeed.draft.train.context_view`); for
    deeper drafts it is StreamingLLM-style eviction. A full refill happens only after a rollback
    before the window, or when positions reach the end of the rotary table. Verification keeps
    the output exact whatever the draft sees.
    """

    def __init__(self, draft: DraftModel, capacity: int, window: int | None = None):
        self.draft = draft
        self.window = window
        self.cache: KVCache = draft.net.new_cache(capacity if window is None else min(capacity, window + window // 2 + 1))
        self.tokens = np.zeros(self.cache.capacity, dtype=np.int64)
        self.offset = 0  # context index of the token in cache slot 0
        self.anchor = 0  # context index of rotary position 0

    def sync(self, context: np.ndarray, logits: bool = False) -> torch.Tensor | None:
        """Make the cache hold `context` [N] int64 (its last `window`-1.5 `window` tokens with a
        window); with `logits`, return the draft logits [Vd] (fp32) for the token after it (its
        last token is then always recomputed). None when the context outgrew the draft's KV
        capacity (without a window; the draft then stays silent)."""
        if self.window is not None and (len(context) < self.offset or len(context) - self.offset > self.cache.capacity):
            start = max(0, len(context) - self.window)
            drop = start - self.offset
            if len(context) < self.offset or len(context) - self.anchor > len(self.draft.net.rope_cos):
                self.offset = self.anchor = start  # refill from rotary position 0
                self.cache.truncate(0)
            else:  # slide: forget the `drop` oldest cached tokens
                c, n = self.cache, self.cache.n
                kept = max(n - drop, 0)
                if kept:
                    c.k[:, :, :, :kept] = c.k[:, :, :, drop:n].clone()
                    c.v[:, :, :, :kept] = c.v[:, :, :, drop:n].clone()
                    c.pos[:kept] = c.pos[drop:n].clone()
                    self.tokens[:kept] = self.tokens[drop:n].copy()
                c.truncate(kept)
                self.offset = start
        context = context[self.offset:]
        if len(context) > self.cache.capacity or len(context) == 0:
            return None
        m = min(self.cache.n, len(context))
        diff = np.flatnonzero(self.tokens[:m] != context[:m])
        keep = int(diff[0]) if len(diff) else m
        if logits:
            keep = min(keep, len(context) - 1)  # recompute >= 1 token
        self.cache.truncate(keep)
        new = context[keep:]
        self.tokens[keep:keep + len(new)] = new
        out = None
        for i in range(0, len(new), 512):  # bounded prefill chunks
            chunk = torch.from_numpy(new[i:i + 512].copy())
            pos = torch.arange(keep + i, keep + i + len(chunk)) + (self.offset - self.anchor)
            out = self.draft.net(chunk, pos, self.cache, "last" if logits and i + 512 >= len(new) else "none")
        return out[0] if logits else None

    def logits(self, context: np.ndarray) -> torch.Tensor | None:
        """Draft logits [Vd] (fp32) after `context` [N] int64 (the session's full token sequence),
        or None when the context outgrew the draft's KV capacity."""
        return self.sync(context, logits=True)


# ------------------------------------------------------------------------------------ adaptivity

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
    made, to keep measuring. Measured on the AAL turns on a 2-core CPU: a call (catching the
    draft's KV up on the tokens verified since its last call, then the next-token logits) costs
    1-2 ms against ~7 ms saved per accepted proposal, but most calls end without a proposal (a
    copy from the request wins, or the proposal would not pay), so the model cost more than it
    saved (turns 0.97-0.99x of plain with it, 1.00-1.02x with prompt lookup alone).

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
        # a few tokens is compute-bound; measured 1.7-2.7x t(1) at T = 2 with 1 thread).
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


# ------------------------------------------------------------------------------------ speculator

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
    """A session's drafting state: drafters, the draft KV cache and adaptive proposal length."""

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

    def observe(self, context: list[int]) -> None:
        """Prefill the draft's KV cache with the session's context (token ids whose target KV is
        cached) as observations arrive, so that drafting at decision time prefills nothing."""
        if self.draft is not None:
            self.draft.sync(np.asarray(context, dtype=np.int64))

    @property
    def max_k(self) -> int:
        """Most proposals per step (0: plain decoding)."""
        return self.config.max_k if self.enabled else 0

    def chain(self, context: list[int], k: int, matcher, allowed, jump_forward: bool, budget: int,
              temperature: float, generator: torch.Generator | None = None,
              source: tuple[int, int] | None = None, n_fed: int = 1, match: MessageMatch | None = None,
              forced_text: ForcedText | None = None
              ) -> tuple[list[int], list[str], list[torch.Tensor | None], list[float | None]]:
        """Draft up to k tokens after `context` (plus the grammar-forced runs after each).

        With `SpecConfig.adaptive`, each proposal must pay for its verification rows
        (`AdaptiveLength.pays`), else the chain ends before it.

        Args:
            context: the full token sequence so far (cached and to-be-fed).
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
        if k <= 0 or budget <= 0:
            return tokens, sources, qs, confs
        adaptive = self.config.adaptive
        ctx = np.asarray(context, dtype=np.int64)
        drafted = consumed = 0
        p_all = 1.0  # estimated probability that every proposal so far is accepted
        vocab_size = None
        sources_on = [s for s, on in ((LOOKUP, self.lookup), (MODEL, self.draft),
                                      (CANONICAL, forced_text if matcher is not None else None)) if on is not None]
        if not sources_on:
            return tokens, sources, qs, confs
        best = max(self.length.estimate(s) for s in sources_on)  # a proposal's best-case estimate
        # When not even the likeliest proposal pays, the step does not draft, except for a
        # periodic one-token probe that keeps the acceptance estimates current.
        probe = adaptive and not self.length.pays(best, n_fed, n_fed + 1) and self.length.probe()
        while drafted < k and len(tokens) < budget:
            rows = n_fed + len(tokens)
            if adaptive and not probe and not self.length.pays(p_all * best, rows, rows + 1):
                break  # not even the likeliest proposal would pay for its row: do not draft
            full = np.concatenate([ctx, np.asarray(tokens, dtype=np.int64)]) if tokens else ctx
            # A copy from the last message (an n-gram continuation there, or the enumeration value
            # it names) is proposed before the draft model: agents copy names and numbers from the
            # request, which the draft model guesses poorly (numbers: 21% vs lookup's 75%).
            looked = forced_text.propose(matcher) if forced_text is not None and matcher is not None else None
            from_msg = looked is not None  # canonical forced text: no other drafter is asked
            src = CANONICAL if from_msg else LOOKUP
            if self.lookup is not None and not from_msg:
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
            tok, q, conf = looked, None, 1.0
            logits = None
            if self.draft is not None and not from_msg and self.length.model_on():
                t_model = time.perf_counter()
                logits = self.draft.logits(full)
                self.model_calls, self.model_s = self.model_calls + 1, self.model_s + time.perf_counter() - t_model
            if logits is not None:
                vocab = self.draft.draft.vocab
                if matcher is not None:
                    logits = logits.masked_fill(~allowed(matcher)[vocab], float("-inf"))
            if logits is not None and not torch.isinf(logits).all():  # the model has a proposal
                probs = torch.softmax(logits / temperature if temperature > 0 else logits, dim=-1)
                top_i = int(probs.argmax())
                # The model's proposal wins unless it is unsure and the context offers a copy;
                # alone, it must be confident enough to be worth a verification row.
                top = float(probs[top_i])
                if looked is None and top < self.config.min_confidence:
                    break
                if looked is None or top >= self.config.lookup_below:
                    src, conf = MODEL, top
                    if temperature > 0:
                        vocab_size = vocab_size or self.draft.draft.net.tok_embeddings.num_embeddings
                        q = torch.zeros(vocab_size)
                        q[vocab] = probs
                        tok = int(torch.multinomial(q, 1, generator=generator))
                    else:
                        tok = int(vocab[top_i])
            if tok is None:
                break
            forced: list[int] = []
            n_this = 0
            if matcher is not None:
                matcher.consume_token(tok)
                n_this = 1
                if jump_forward and not matcher.is_stopped():
                    forced = matcher.compute_ff_tokens()[: max(budget - len(tokens) - 1, 0)]
                    if forced and matcher.consume_tokens(forced):
                        n_this += len(forced)
                    else:
                        forced = []
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


def _discard(session, n_drop: int) -> None:
    """Drop the KV and token ids of the last n_drop cached tokens (rejected draft tokens)."""
    if n_drop:
        session.cache.truncate(session.cache.n - n_drop)
        del session.tokens[len(session.tokens) - n_drop:]


def decode(session, feed: list[int], d, *, matcher=None, jump_forward: bool = True, max_tokens: int = 256,
           deadline_at: float | None = None, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, t0: float | None = None, on_token=None) -> tuple[list[int], list[int]]:
    """The decode loop of `Session.decide()` and `Session.generate()`, speculative when the session
    has drafters (`session.speculator`), plain otherwise.

    Args:
        session: the `Session` (its model, KV cache, token ids and speculator are used).
        feed: tokens to feed before the first decision (not yet in the KV cache).
        d: the `Decision` whose counters and timings are filled (a fresh one for generate()).
        matcher: llguidance matcher (grammar) or None (free text; stops at a stop token).
        jump_forward: append grammar-forced tokens without sampling them.
        max_tokens: most output tokens (forced ones included); reached -> d.reason is set.
        deadline_at: absolute `time.monotonic()` deadline; passed -> d.status = "deadline_missed".
        temperature, top_p, generator: sampling (temperature 0: greedy).
        t0: `time.perf_counter()` at the call's start (for ttft_s).
        on_token: callback(list[int]) receiving the output token ids after each step; returning
            True ends the answer after that step.
    Returns:
        (out, feed): the output token ids (stop token excluded), and the last chosen token(s)
        not yet in the KV cache.
    """
    spec: Speculator = session.speculator
    mask = session._mask
    stop_ids = set(session.tok.stop_ids)
    t0 = time.perf_counter() if t0 is None else t0
    t_last = None
    out: list[int] = []
    source = copy_source(session.tokens + feed, len(session.tokens) + len(feed), stop_ids) if spec.lookup else None
    match = None
    if source is not None and matcher is not None:
        texts = spec.token_texts

        def token_text(i: int) -> str:
            if i not in texts:
                texts[i] = session.tok.decode([i])
            return texts[i]

        match = MessageMatch(session.tok.decode((session.tokens + feed)[source[0]:source[1]], skip_special=True), token_text)
    forced_text = ForcedText(session.tok.encode) if spec.forced_text and matcher is not None else None
    while True:
        if matcher is not None:
            if jump_forward:
                forced = matcher.compute_ff_tokens()
                if forced and matcher.consume_tokens(forced):
                    feed = feed + forced
                    out.extend(forced)
                    d.forced_tokens += len(forced)
            if matcher.is_stopped():
                break
        if deadline_at is not None and time.monotonic() >= deadline_at:
            d.status, d.reason = "deadline_missed", f"deadline passed after {len(out)} tokens"
            break
        if len(out) >= max_tokens:
            d.reason = f"no complete call within max_tokens={max_tokens}"
            break
        t_draft = time.perf_counter()
        allowed = mask.allowed if matcher is not None else None
        chain, sources, qs, confs = spec.chain(session.tokens + feed, spec.max_k, matcher, allowed, jump_forward,
                                               max_tokens - len(out) - 1, temperature, generator, source, len(feed),
                                               match, forced_text)
        t_draft = time.perf_counter() - t_draft
        if len(feed) + len(chain) > 512:  # keep the verified rows in one forward
            session._forward(feed[:-1], "none")
            feed = feed[-1:]
        ids = feed + chain
        # Logits only where a token is chosen: the rows of proposals and the last row (a
        # grammar-forced token needs none; the lm_head is 1.3 ms per row on CPU).
        choose = [r for r in range(len(chain) + 1) if r == len(chain) or sources[r] != GRAMMAR]
        at = {r: i for i, r in enumerate(choose)}
        t_fwd = time.perf_counter()
        logits = session._forward(ids, torch.tensor(choose) + len(feed) - 1)  # [len(choose), V]
        t_fwd = time.perf_counter() - t_fwd
        d.forwards += 1
        proposals: list[tuple[str, float, bool]] = []  # (source, confidence, accepted) as verified
        stop = False
        next_feed: list[int] = []
        emitted = 0
        row = 0
        for row in range(len(chain) + 1):
            src = sources[row] if row < len(chain) else None
            if src == GRAMMAR:  # forced after an accepted token: plain decoding forces it too
                matcher.consume_token(chain[row])
                out.append(chain[row])
                d.forced_tokens += 1
                continue
            if src is not None:
                d.draft_tokens += 1
                d.draft_sources.setdefault(src, [0, 0])[0] += 1
            if matcher is not None and row == len(chain) and (
                    matcher.is_stopped() or (jump_forward and matcher.compute_ff_tokens())):
                break  # the call is complete, or the chain was cut inside a forced run (forced next step)
            logits_row = logits[at[row]:at[row] + 1]
            if matcher is not None:
                mask.apply(matcher, logits_row)
            token, ok = _choose(logits_row[0], chain[row] if src else None, qs[row] if src else None,
                                temperature, top_p, generator)
            if src is not None:
                proposals.append((src, confs[row], ok))
            if ok:
                d.accepted_tokens += 1
                d.draft_sources[src][1] += 1
            d.generated_tokens += 1
            emitted += 1
            if token in stop_ids and (matcher is None or matcher.is_accepting()):
                stop = True
                break
            if matcher is not None and not matcher.consume_token(token):
                d.reason = f"grammar rejected token {token}: {matcher.get_error()}"
                stop = True
                break
            out.append(token)
            if not ok or (matcher is None and len(out) >= max_tokens):
                next_feed = [token]  # chosen, not yet in the KV cache
                break
        # The walk always breaks at some row: the last row has no proposal. The KV keeps the fed
        # tokens and chain[:row], the accepted prefix.
        now = time.perf_counter()
        if emitted:
            if t_last is None:
                d.ttft_s = now - t0
            else:  # amortised: a step that emits several tokens spreads its time over them
                d.itl_s.extend([(now - t_last) / emitted] * emitted)
            t_last = now
        _discard(session, len(chain) - row)
        if spec.enabled:
            spec.length.record(len(ids), t_fwd, proposals, t_draft, spec.model_calls, spec.model_s, len(chain) - row)
            spec.model_calls, spec.model_s = 0, 0.0
        if on_token is not None and on_token(out):
            stop = True  # the caller ends the answer here (a stop sequence)
        feed = next_feed
        if stop or (matcher is None and len(out) >= max_tokens):
            break
    return out, feed


def _choose(logits: torch.Tensor, proposal: int | None, q: torch.Tensor | None, temperature: float,
            top_p: float, generator: torch.Generator | None) -> tuple[int, bool]:
    """The target's token at one position, and whether it is the proposal (accepted).

    Greedy: the argmax; the proposal is accepted iff it equals it. Sampling: speculative rejection
    sampling - accept x ~ q with probability min(1, p(x) / q(x)); on rejection sample from
    norm(max(p - q, 0)) (q is one-hot for deterministic proposals); with no proposal sample p.
    """
    if temperature <= 0:
        token = int(logits.argmax())
        return token, token == proposal
    p = token_probs(logits, temperature, top_p)
    if proposal is None:
        return int(torch.multinomial(p, 1, generator=generator)), False
    qx = float(q[proposal]) if q is not None else 1.0
    u = float(torch.rand((), generator=generator))
    if u * qx < float(p[proposal]):
        return proposal, True
    if q is None:
        residual = p.clone()
        residual[proposal] = 0.0
    else:
        residual = (p - q).clamp_min_(0.0)
    if float(residual.sum()) <= 0:
        residual = p
    return int(torch.multinomial(residual, 1, generator=generator)), False
