"""Tokenizer and chat formatting.

`Tokenizer` wraps a Hugging Face `tokenizers` BPE model (from `tokenizer.json`) and renders the
model's own Jinja chat template. For GGUF files the `tokenizer.json` is rebuilt from the GGUF
vocabulary/merges (`tokenizer_files_from_gguf`), following the GGUF spec's `tokenizer.ggml.*`
keys and llama.cpp's pre-tokenizer names. `grammar_tokenizer` builds llguidance's tokenizer from it,
each token's bytes cached.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from pathlib import Path

from .paths import cache_entry

__all__ = ["Tokenizer", "tokenizer_files_from_gguf", "grammar_tokenizer", "write_grammar_tokens"]

log = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizers by llama.cpp `tokenizer.ggml.pre` name. Digits are split one by one for the
# SmolLM/StarCoder family; everything else falls back to GPT-2 byte-level splitting.
_SPLIT_DIGITS = {"smollm", "starcoder", "refact", "deepseek-coder"}


def tokenizer_files_from_gguf(metadata: dict) -> tuple[str, dict]:
    """Build `tokenizer.json` text and a `tokenizer_config.json` dict from a GGUF file's metadata.

    Args:
        metadata: GGUF key -> its value as Python (`tokenspeed.weights._gguf_tensors`): the
            `tokenizer.ggml.*` keys and `tokenizer.chat_template`.

    Raises:
        ValueError: the GGUF tokenizer is not a byte-level BPE (`tokenizer.ggml.model == "gpt2"`).
    """
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} not supported (only byte-level BPE 'gpt2')")
    tokens = metadata.get("tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if metadata.get("tokenizer.ggml.pre", "") in _SPLIT_DIGITS:
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)])
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": metadata.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    return tok.to_str(), config


class Tokenizer:
    """Text <-> token ids and chat formatting for one model folder.

    Attributes:
        vocab_size: number of token ids (int).
        eos_id: end-of-sequence / end-of-turn token id.
        stop_ids: ids that end a turn (eos plus the chat template's end-of-turn token if any).
        assistant_prefix, assistant_suffix: the text the chat template writes before and after an
            assistant message's content (ChatML: "<|im_start|>assistant\\n", "<|im_end|>\\n"):
            the session's trigger and end of an answer, taken from the model's own template.
        system_moves: the template writes the system message with the last user message rather
            than once at the start (Mistral): the session then writes it once, with the first
            message after it (see `Session`).
        json: the `tokenizer.json` text (`grammar_tokenizer` keys its cache entry on it).
    """

    def __init__(self, folder: Path):
        """Load `folder`'s tokenizer.json and tokenizer_config.json.

        Raises:
            ModelLoadError (`tokenspeed.weights`): a file is missing or unreadable, or a
                tokenizer_config.json key has the wrong type or value: chat_template not a string
                (or a list of {"name", "template"} with a "default"), a template that does not
                compile or render a conversation, bos_token/eos_token not a token of the vocabulary
                (the message names the file and the key).
        """
        from tokenizers import Tokenizer as HFTokenizer

        from .weights import ModelLoadError

        try:
            self.json = (folder / "tokenizer.json").read_text()
            self._tok = HFTokenizer.from_str(self.json)
        except Exception as exc:  # OSError, or the tokenizers library's own errors for a malformed file
            raise ModelLoadError(f"cannot read {folder / 'tokenizer.json'}: {exc}") from exc
        self._tok.no_padding()
        self._tok.no_truncation()
        # One parsed tokenizer for both kinds of text (a second parse of tokenizer.json cost ~0.12 s
        # of every load): its `encode_special_tokens` flag is set for each call, under this lock.
        self._encode_lock = threading.Lock()
        cfg_path = folder / "tokenizer_config.json"
        where = str(cfg_path)
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {where}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{where}: not a JSON object")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = _chat_template(cfg.get("chat_template"), where)
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.bos_id = self._special_id(cfg.get("bos_token"), f"{where}: bos_token")
        self.eos_id = self._special_id(cfg.get("eos_token"), f"{where}: eos_token")
        self._eos_text = self._tok.id_to_token(self.eos_id) if self.eos_id is not None else ""
        self._template = None
        try:
            self.assistant_prefix, self.assistant_suffix = self._assistant_affixes()
            self.system_moves = self._system_moves()
        except ValueError as exc:  # the template does not compile, or does not render a plain conversation
            raise ModelLoadError(f"{where}: chat_template: {exc}") from exc
        # The template's end-of-turn token (e.g. ChatML's <|im_end|>, Llama 3's <|eot_id|>) ends a turn too.
        end_turn = [i for i in self._tok.encode(self.assistant_suffix, add_special_tokens=False).ids
                    if self._tok.decode([i], skip_special_tokens=True) == ""][:1]
        self.stop_ids = sorted({i for i in [self.eos_id, *end_turn] if i is not None})

    def _assistant_affixes(self) -> tuple[str, str]:
        # What the template writes before and after an assistant message's content, found by
        # rendering a probe conversation with and without the generation prompt.
        probe = [{"role": "user", "content": "ping"}]
        head = self.render_chat(probe)
        prompt = self.render_chat(probe, add_generation_prompt=True)
        full = self.render_chat(probe + [{"role": "assistant", "content": _MARK}])
        if not (prompt.startswith(head) and full.startswith(prompt) and _MARK in full):
            raise ValueError("the chat template does not render an assistant turn after the generation prompt")
        at = full.index(_MARK)
        return full[len(head):at], full[at + len(_MARK):]

    def _system_moves(self) -> bool:
        # Where the template writes the system text in a two-turn conversation: after the first
        # user message means it travels with the last one.
        text = self.render_chat([{"role": "system", "content": _MARK}, {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}])
        return _MARK in text and text.index(_MARK) > text.find("u1") >= 0

    def _special_id(self, token, where: str) -> int | None:
        from .weights import ModelLoadError

        if isinstance(token, dict):  # AddedToken serialised as a dict
            token = token.get("content")
        if not token:
            return None
        i = self._tok.token_to_id(token) if isinstance(token, str) else None
        if i is None:
            raise ModelLoadError(f"{where}={token!r:.40} is not a token of tokenizer.json")
        return i

    @functools.cached_property
    def grammar_entry(self) -> Path:
        """The cache entry of this tokenizer's grammar token bytes (`grammar_tokenizer`,
        `write_grammar_tokens`): named by tokenizer.json's digest, the vocabulary size, the EOS id and
        llguidance's version; hashed once per tokenizer."""
        import llguidance

        return cache_entry("grammar_tokens", self.json, f"{self.vocab_size}:{self.eos_id}:{llguidance.__version__}")

    def encode(self, text: str) -> list[int]:
        """Token ids of trusted template text: special tokens written literally (`<|im_end|>`)
        are recognised, no BOS added. Never use it on text from users, topics or feeds."""
        return self._ids(text, special=True)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of untrusted text as plain text only: a special token written in it
        (`<|im_end|>`) is split into ordinary tokens, so the text cannot end a turn or open one."""
        return self._ids(text, special=False)

    def _ids(self, text: str, special: bool) -> list[int]:
        # Token ids of `text`, no special tokens added; special: special tokens written in the text
        # are recognised (else split into ordinary tokens). Through `encode_batch`, which releases
        # the GIL while it runs (same ids, same cost): `encode` holds it, 48 ms for 32 KB of text
        # here, and no other thread of the process runs meanwhile (the server's event loop while a
        # request is prepared; ROS callbacks while the engine observes).
        with self._encode_lock:
            self._tok.encode_special_tokens = not special
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_chat(self, messages: list[dict], head: list[dict] = ()) -> list[int]:
        """Token ids of `messages` rendered with the chat template after the `head` messages
        (whose tokens are left out): the template's own text is encoded with its special tokens,
        every message content with `encode_text`, so content can never forge a turn.

        Args:
            messages: [{"role": str, "content": str}] to render.
            head: messages rendered before them and left out (the chat template is
                prefix-stable: rendering the tail alone is O(message), not O(history)).
        """
        both = [*head, *messages]
        # Render with a placeholder per content, then encode the contents on their own.
        stubs = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(both)]
        rendered = self.render_chat(stubs)
        if head:
            rendered = rendered[len(self.render_chat(stubs[:len(head)])):]
        ids: list[int] = []
        for k, piece in enumerate(_PLACEHOLDER.split(rendered)):
            if k % 2 == 0:
                ids += self.encode(piece) if piece else []
            else:
                ids += self.encode_text(both[int(piece)]["content"])
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of token ids."""
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """Render chat messages ([{"role", "content"}]) with the model's own Jinja chat template, in
        the non-thinking mode of the templates that have one (`enable_thinking=False`: Qwen3, SmolLM3).

        Falls back to ChatML when the model ships no template.

        Raises:
            ValueError: the template refuses the conversation (its `raise_exception`, e.g.
                Mistral's "roles must alternate"; the message is the template's), does not compile,
                or fails while rendering it (the message names jinja2's error).
        """
        import jinja2

        try:
            if self._template is None:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                # raise_exception as transformers' apply_chat_template defines it (Mistral's templates
                # call it on a bad role order). strftime_now is left undefined on purpose: Llama 3.2's
                # template then writes its fixed default date, so a rendering never changes at midnight
                # (the session relies on a message rendering the same way every time).
                env.globals["raise_exception"] = _raise_template_error
                self._template = env.from_string(self.chat_template or _CHATML)
            # enable_thinking=False: an agent's answer is the call itself. Qwen3's and SmolLM3's templates
            # then write an empty `<think>\n\n</think>` block after the assistant header (their
            # non-thinking mode), so the answer's prefix closes the reasoning before the grammar starts.
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token="", eos_token=self._eos_text, enable_thinking=False)
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError, ZeroDivisionError,
                OverflowError, RecursionError) as exc:
            # what a template's own code can raise (a ValueError from raise_exception passes as it is)
            raise ValueError(f"chat template: {type(exc).__name__}: {exc}") from None


def grammar_tokenizer(tok: Tokenizer):
    """llguidance's tokenizer for `tok` (grammar compilation and token masks): an `llguidance.LLTokenizer`.

    llguidance builds it from the tokenizer.json text: a second parse of the vocabulary and merges,
    then each token's bytes, then its token trie and mask slices (0.67 s at Qwen2.5's 152k tokens on
    one AVX2 core). The first build writes each token's bytes as llguidance made them (added
    tokens with its special marker) and its EOS to a cache entry keyed on the tokenizer.json text, the
    vocabulary size, the EOS id and llguidance's version (`tokenspeed.paths.cache_entry`); later builds
    hand those bytes to llguidance through its `TokenizerWrapper`, with `tok.encode` as the text
    tokenizer (what llguidance's own tokenizer runs: the Hugging Face tokenizer, added tokens
    recognised, none added): only the trie and the slices are built (0.32 s at 152k tokens). The first
    build returns such a wrapped tokenizer too, built from the bytes it has just taken from the text one
    (which it drops: its own Hugging Face tokenizer held 23 MiB more at 152k tokens, for the life of the
    process). Where the tokenizer has a normalizer (llguidance strips a `Prepend` one, `tok.encode`
    would not), it is built from the text every time. The result is the same either way: the same token
    bytes, special tokens, EOS, vocabulary size and tokenization. A cache that cannot be written is logged.
    """
    import llguidance

    path = tok.grammar_entry
    same_encoding = tok._tok.normalizer is None  # tok.encode tokenizes as llguidance's own tokenizer does
    cached = _read_token_bytes(path) if same_encoding else None
    if cached is None:
        if not same_encoding:
            return llguidance.LLTokenizer(tok.json, n_vocab=tok.vocab_size, eos_token=tok.eos_id)
        cached = _token_bytes_from_text(tok, path)
    eos, tokens = cached
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok, tokens, eos)))


def write_grammar_tokens(tok: Tokenizer) -> None:
    """Make the cache entry of `tok`'s grammar token bytes that `grammar_tokenizer` reads, if there is
    none (and the tokenizer has no normalizer): llguidance's build from the tokenizer.json text, its
    bytes written, then dropped and its heap returned. `Engine.load` calls it before the weights, so
    the first build's transient memory (+113 MiB at Qwen2.5's 152k tokens) is gone before they arrive
    rather than stacked on them; the grammar tokenizer is built from the entry when first needed
    (`Engine.ll_tokenizer`)."""
    path = tok.grammar_entry
    if tok._tok.normalizer is None and not path.is_file():
        _token_bytes_from_text(tok, path)


def _token_bytes_from_text(tok: Tokenizer, path: Path) -> tuple[int, list[bytes]]:
    # (EOS, each token's bytes) as llguidance's own build from tokenizer.json makes them (a special token
    # marked with a leading 0xff byte), written to the cache entry `path`
    import llguidance

    from .weights import return_free_heap

    ll = llguidance.LLTokenizer(tok.json, n_vocab=tok.vocab_size, eos_token=tok.eos_id)
    eos, tokens = ll.eos_token, [(b"\xff" if ll.is_special_token(i) else b"") + ll.decode_bytes([i])
                                 for i in range(ll.vocab_size)]
    del ll  # with its own parse of tokenizer.json: 23 MiB more than the wrapped one's at 152k tokens
    return_free_heap()
    _write_token_bytes(path, eos, tokens)
    return eos, tokens


class _Vocabulary:
    # What `llguidance.TokenizerWrapper` wraps: token bytes, EOS/BOS ids and a text -> ids callable.
    def __init__(self, tok: Tokenizer, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id, self.bos_token_id, self.special_token_ids = tokens, eos, tok.bos_id, []
        self._encode = tok.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes: it then passes text
            raise TypeError("text must be a str")
        return self._encode(text)


_TOKENS_MAGIC = b"tokenspeed grammar tokens 1 "  # then {"eos": id, "n": count} JSON, a newline, n uint32 lengths, the bytes


def _write_token_bytes(path: Path, eos: int, tokens: list[bytes]) -> None:
    import numpy as np

    head = _TOKENS_MAGIC + json.dumps({"eos": eos, "n": len(tokens)}).encode() + b"\n"
    body = np.fromiter(map(len, tokens), dtype="<u4", count=len(tokens)).tobytes() + b"".join(tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(head + body)
        tmp.replace(path)
    except OSError as exc:
        log.warning("grammar tokenizer's token bytes not cached (%s)", exc)


def _read_token_bytes(path: Path) -> tuple[int, list[bytes]] | None:
    # (eos, each token's bytes) of a `_write_token_bytes` entry, or None (absent, truncated or malformed)
    import numpy as np

    try:
        data = path.read_bytes()
        if not data.startswith(_TOKENS_MAGIC):
            return None
        head, _, body = data[len(_TOKENS_MAGIC):].partition(b"\n")
        meta = json.loads(head)
        n, eos = int(meta["n"]), int(meta["eos"])
        ends = np.cumsum(np.frombuffer(body, dtype="<u4", count=n), dtype=np.int64) + 4 * n
        if n == 0 or int(ends[-1]) != len(body):
            return None
        ends = ends.tolist()
        return eos, [body[a:b] for a, b in zip([4 * n, *ends[:-1]], ends)]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _chat_template(value, where: str) -> str | None:
    # tokenizer_config.json's chat_template: a string, or transformers' list of named templates
    # (the "default" one is the chat template), or absent
    from .weights import ModelLoadError

    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise ModelLoadError(f"{where}: chat_template is a list without a template named 'default'")
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{where}: chat_template must be a string, got {type(value).__name__}")
    return value


def _raise_template_error(message: str):
    raise ValueError(f"chat template: {message}")


_MARK = "\x00answer\x00"  # probe content no template alters
_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")
_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
           " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
