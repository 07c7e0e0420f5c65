"""tool_choice="auto": call when a tool applies, answer in text when none does.

The rule uses the model's own evidence at the answer's first position: `AutoRule` takes the
probability mass p(call) the model puts on the tokens that open a call, in its family's format
(`ToolGrammar.call_start`) or written another way (bare JSON, a code fence:
`ToolGrammar.call_evidence`), against the other text tokens the grammar allows there, and calls
when p(call) >= a threshold (the answer is then written in the family's format); otherwise the
answer is text. A small model rarely puts a call first even
where one applies (SmolLM2-135M: never, on the labelled set below), yet its p(call) is several
times higher where one applies: the threshold is where the two cases part.

The threshold is calibrated once per model and tool-listing prompt (`tokenspeed bench auto
--calibrate`) on the labelled set `LABELLED` and stored in the cache beside the converted models:
`auto_threshold.json`, keyed by the model (`model_key`) and the prompt, with the evidence it was
measured on (`EVIDENCE`: a calibration of another evidence is not used); the embedded model's
calibration ships with the engine (`SHIPPED`). A request overrides it with `auto_threshold` (`Session.decide`, the serve request's
extra field, `ChatTokenSpeed`). A model with no calibration keeps the plain rule (the first token
is the masked argmax, so a call only when the model puts one first).

The labelled set (`LABELLED`, written for TokenSpeed; the BFCL rows name held-in cases of the
shipped BFCL data, Apache-2.0): questions where a robot or market tool applies, held-in BFCL
questions with their own function, and questions where no tool applies, asked with the robot,
market or a BFCL tool set listed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .paths import cache_dir

__all__ = ["AutoRule", "EVIDENCE", "LABELLED", "SHIPPED", "model_key", "stored_thresholds", "store_threshold", "calibrate",
           "labelled_cases", "held_out"]

LABELLED = Path(__file__).resolve().parent / "data" / "auto_labelled.jsonl"
SHIPPED = Path(__file__).resolve().parent / "data" / "auto_threshold.json"
CACHE_NAME = "auto_threshold.json"  # in `cache_dir()`: this machine's calibrations
EVIDENCE = "call+json+fence"  # what p(call) sums (`ToolGrammar.call_evidence`); calibrations name it


@dataclass(frozen=True)
class AutoRule:
    """The decision at an "auto" answer's first position.

    Attributes:
        call_start: [V] bool on the model's device: the ids that open a call (the call grammar's
            first mask, `ToolGrammar.call_start`): the call branch.
        evidence: [V] bool on the model's device: the ids whose mass is p(call)
            (`ToolGrammar.call_evidence`: `call_start`, bare JSON and code-fence openers).
        threshold: call when p(call) >= threshold, in [0, 1] (1: never, the answer is text);
            None: the plain masked argmax.
    """

    call_start: torch.Tensor
    evidence: torch.Tensor
    threshold: float | None

    def apply(self, logits: torch.Tensor) -> float:
        """Settle call or text on the first position's grammar-masked logits [1, V] (in place:
        the other branch's ids become -inf, unless `threshold` is None).

        Returns:
            p(call): the softmax mass of `evidence` among the allowed ids (one softmax over
            logits the step already has; read on the host).
        """
        p = torch.softmax(logits[0].float(), -1)
        p_call = float(p[self.evidence[: p.shape[0]]].sum())
        if self.threshold is not None:
            call = p_call >= self.threshold and self.threshold < 1
            losing = ~self.call_start if call else self.call_start
            logits[0, : len(losing)].masked_fill_(losing, float("-inf"))
        return p_call


def model_key(folder: Path) -> str:
    """How calibrations name a model: its converted folder's name under the cache (a GGUF's
    sha256), else the folder's resolved path."""
    folder = Path(folder).resolve()
    return folder.name if folder.parent == (cache_dir() / "gguf").resolve() else str(folder)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def stored_thresholds(folder: Path) -> dict[str, float]:
    """The calibrated thresholds of the model in `folder`, per tool-listing prompt
    (`tokenspeed.grammar.TOOL_PROMPTS`): the shipped ones (`SHIPPED`) updated by this machine's
    (`cache_dir()/auto_threshold.json`), of the current `EVIDENCE` only; {} when there is none."""
    key, out = model_key(folder), {}
    for path in (SHIPPED, cache_dir() / CACHE_NAME):
        entries = _read(path).get(key)
        for prompt, entry in (entries.items() if isinstance(entries, dict) else ()):
            if isinstance(entry, dict) and isinstance(entry.get("threshold"), (int, float)) \
                    and entry.get("evidence") == EVIDENCE:
                out[prompt] = float(entry["threshold"])
    return out


def store_threshold(folder: Path, tool_prompt: str, threshold: float, report: dict) -> Path:
    """Record the model's calibrated threshold under `tool_prompt` (with what it was measured on)
    in `cache_dir()/auto_threshold.json`; returns the file."""
    path = cache_dir() / CACHE_NAME
    data = _read(path)
    data.setdefault(model_key(folder), {})[tool_prompt] = {"threshold": threshold, "evidence": EVIDENCE, **report}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    return path


def calibrate(p_applies: list[float], p_none: list[float], max_false: float = 0.10) -> float:
    """The threshold that calls most often where a tool applies while calling in at most
    `max_false` of the cases where none does (ties: the midpoint of the widest gap, the most robust).

    Args:
        p_applies / p_none: p(call) at the first position of each labelled case.
    Raises:
        ValueError: an empty list.
    """
    if not p_applies or not p_none:
        raise ValueError("calibration needs cases of both labels")
    allowed = int(max_false * len(p_none))
    none = sorted(p_none, reverse=True)
    floor = none[allowed] if allowed < len(none) else 0.0   # the threshold must be above this
    above = sorted(p for p in p_applies if p > floor)
    if not above:
        return min(1.0, floor * 1.5 + 1e-9)
    return (floor + above[0]) / 2


def held_out(cases: list[dict]) -> list[bool]:
    """Which of `cases` (`labelled_cases`, in its order) calibration leaves out, to report on:
    every second case of each source and label (the 2nd, 4th, ...); the others are held in (the
    threshold is chosen on them)."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for c in cases:
        k = (c["source"], c["label"])
        seen[k] = seen.get(k, 0) + 1
        out.append(seen[k] % 2 == 0)
    return out


def labelled_cases(bfcl: Path | None = None) -> list[dict]:
    """The labelled set with its tools and messages: [{"id", "label" ("call" | "text"), "source"
    ("robot" | "market" | "bfcl"), "tools": [OpenAI tool], "messages": [{"role", "content"}]}].

    BFCL rows read the held-in case they name (`tokenspeed.bfcl.load_bfcl`); a BFCL row whose
    question is null asks that case's own question.
    """
    from .bfcl import load_bfcl
    from .tools import tool_set

    bfcl_cases = {c["id"]: c for c in load_bfcl("train", bfcl)}
    out = []
    for line in LABELLED.read_text().splitlines():
        row = json.loads(line)
        if row["tools"].startswith("bfcl:"):
            case = bfcl_cases[row["tools"][5:]]
            tools, source = case["tools"], "bfcl"
            messages = case["messages"] if row["question"] is None else [{"role": "user", "content": row["question"]}]
        else:
            tools, source = tool_set(row["tools"]), "robot" if row["tools"] == "robot" else "market"
            messages = [{"role": "user", "content": row["question"]}]
        out.append({"id": row["id"], "label": row["label"], "source": source, "tools": tools, "messages": messages})
    return out
