"""Speculative decoding: drafters propose a chain of tokens that the target verifies in one forward.

`drafters` (prompt lookup, the request's words, grammar-forced text), `draft_model` (the co-located
draft Llama, its save/load and per-session KV), `adaptive` (whether one more proposal pays),
`speculator` (the configuration and a session's drafting state). The loop that verifies the
chains is `tokenspeed.decode`.
"""
from .adaptive import AdaptiveLength
from .draft_model import DEFAULT_DRAFT, DraftModel, DraftState, fingerprint
from .drafters import ForcedText, MessageMatch, PromptLookup, copy_source
from .speculator import SpecConfig, Speculator

__all__ = ["SpecConfig", "Speculator", "PromptLookup", "MessageMatch", "ForcedText", "copy_source", "DraftModel",
           "DraftState", "fingerprint", "AdaptiveLength", "DEFAULT_DRAFT"]
