"""Drafters: where a proposed next token comes from (prompt lookup, the request's words, grammar-forced text).

Each proposes at most one token per call; the `Speculator` orders them and checks every proposal
against the grammar before it costs a verification row.
"""
from __future__ import annotations

import re

import numpy as np
import torch

__all__ = ["PromptLookup", "MessageMatch", "ForcedText", "copy_source", "GRAMMAR", "LOOKUP", "MODEL", "CANONICAL"]

# Where a chain token came from: grammar-forced (no verification needed), prompt lookup, the draft
# model, or the canonical tokenization of grammar-forced text.
GRAMMAR, LOOKUP, MODEL, CANONICAL = "grammar", "lookup", "model", "canonical"


class PromptLookup:
    """Propose the token that followed an earlier occurrence of the context's last n-gram.

    Tries n = max_ngram down to min_ngram (longer matches first). Source: Saxena 2023,
    "Prompt Lookup Decoding", which takes the latest occurrence. A tool call copies values from
    its source (the user's request, an observation) in their order, and a short n-gram such as
    "0 ." occurs once per number there, so given the output's `source` (`copy_source`), the
    occurrences in the last message are tried first, then those in the `window` tokens before
    it, each oldest first, skipping those whose proposal the output has already copied (the
    pair (last n-gram token, proposal) occurs in the output). Otherwise (or when all are used)
    the latest occurrence is proposed. Only the last `horizon` tokens are searched, so a proposal
    costs the same after hours of streamed observations as in a fresh session.

    Raises (constructor): ValueError for n-gram bounds out of order or a window or horizon < 1.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, window: int = 512, horizon: int = 4096):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if window < 1 or horizon < 1:
            raise ValueError(f"window and horizon must be >= 1 token, got {window}, {horizon}")
        self.max_ngram, self.min_ngram, self.window, self.horizon = max_ngram, min_ngram, window, horizon

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
        start = max(0, len(context) - self.horizon)
        searched = context[start:]
        for n in range(min(self.max_ngram, len(searched) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(searched[:-1], n)  # [H - n, n]
            hits = np.flatnonzero((windows == searched[-n:]).all(axis=1)) + start  # indices in `context`
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
    seen = 0
    for i in range(out_start - 1, -1, -1):  # back from the output: O(last two messages), not O(context)
        if context[i] in end_ids:
            seen += 1
            if seen == 2:
                return i + 1, out_start
    return 0, out_start
