"""Former home of speculative decoding, kept so that `tokenspeed.speculative` imports keep working:
the code lives in `tokenspeed.speculation` (drafters, draft model, adaptive length, speculator)
and `tokenspeed.decode` (the decode loop)."""
from .decode import decode, token_probs
from .speculation import (DEFAULT_DRAFT, AdaptiveLength, DraftModel, DraftState, ForcedText, MessageMatch,
                          PromptLookup, SpecConfig, Speculator, copy_source, fingerprint)

__all__ = ["SpecConfig", "PromptLookup", "MessageMatch", "ForcedText", "copy_source", "DraftModel", "DraftState",
           "AdaptiveLength", "Speculator", "decode", "token_probs", "DEFAULT_DRAFT", "fingerprint"]
