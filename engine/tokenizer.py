"""Tokenizer and chat formatting.

`Tokenizer` wraps a Hugging Face `tokenizers` BPE model (from `tokenizer.json`) and renders the
model's own Jinja chat template. For GGUF files the `tokenizer.json` is rebuilt from the GGUF
vocabulary/merges (`tokenizer_files_from_gguf`), following the GGUF spec's `tokenizer.ggml.*`
keys and llama.cpp's pre-tokenizer names.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["Tokenizer", "tokenizer_files_from_gguf"]

# GGUF token types (gguf.TokenType): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizers by llama.cpp `tokenizer.ggml.pre` name. Digits are split one by one for the
# SmolLM/StarCoder family; everything else falls back to GPT-2 byte-level splitting.
_SPLIT_DIGITS = {"smollm", "starcoder", "refact", "deepseek-coder"}


def tokenizer_files_from_gguf(reader, field) -> tuple[str, dict]:
    """Build `tokenizer.json` text and a `tokenizer_config.json` dict from a GGUF reader.

    Args:
        reader: a `gguf.GGUFReader`.
        field: `field(reader, key, default)` accessor returning python values.

    Raises:
        ValueError: the GGUF tokenizer is not a byte-level BPE (`tokenizer.ggml.model == "gpt2"`).
    """
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} not supported (only byte-level BPE 'gpt2')")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if field(reader, "tokenizer.ggml.pre", "") in _SPLIT_DIGITS:
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)])
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": field(reader, "tokenizer.chat_template"),
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
        json: the `tokenizer.json` text (for llguidance).
    """

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HFTokenizer

        self.json = (folder / "tokenizer.json").read_text()
        self._tok = HFTokenizer.from_str(self.json)
        self._tok.no_padding()
        self._tok.no_truncation()
        # The same model with special tokens never parsed: for text that comes from outside.
        self._text_tok = HFTokenizer.from_str(self.json)
        self._text_tok.no_padding()
        self._text_tok.no_truncation()
        self._text_tok.encode_special_tokens = True
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = cfg.get("chat_template")
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.bos_id = self._special_id(cfg.get("bos_token"))
        self.eos_id = self._special_id(cfg.get("eos_token"))
        self._eos_text = self._tok.id_to_token(self.eos_id) if self.eos_id is not None else ""
        self._template = None
        self.assistant_prefix, self.assistant_suffix = self._assistant_affixes()
        self.system_moves = self._system_moves()
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

    def _special_id(self, token) -> int | None:
        if isinstance(token, dict):  # AddedToken serialised as a dict
            token = token.get("content")
        return self._tok.token_to_id(token) if token else None

    def encode(self, text: str) -> list[int]:
        """Token ids of trusted template text: special tokens written literally (`<|im_end|>`)
        are recognised, no BOS added. Never use it on text from users, topics or feeds."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of untrusted text as plain text only: a special token written in it
        (`<|im_end|>`) is split into ordinary tokens, so the text cannot end a turn or open one."""
        return self._text_tok.encode(text, add_special_tokens=False).ids

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
        """Render chat messages ([{"role", "content"}]) with the model's own Jinja chat template.

        Falls back to ChatML when the model ships no template.

        Raises:
            ValueError: the template refuses the conversation (its `raise_exception`, e.g.
                Mistral's "roles must alternate"); the message is the template's.
        """
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            # raise_exception as transformers' apply_chat_template defines it (Mistral's templates
            # call it on a bad role order). strftime_now is left undefined on purpose: Llama 3.2's
            # template then writes its fixed default date, so a rendering never changes at midnight
            # (the session relies on a message rendering the same way every time).
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template or _CHATML)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token="", eos_token=self._eos_text)


def _raise_template_error(message: str):
    raise ValueError(f"chat template: {message}")


_MARK = "\x00answer\x00"  # probe content no template alters
_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")
_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
           " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
