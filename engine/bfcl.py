"""BFCL simple_python prompts and function schemas as OpenAI tools.

Source: Berkeley Function Calling Leaderboard v4 (ShishirPatil/gorilla, Apache-2.0), shipped
with the package in `tokenspeed/data/bfcl/` (its README names the commit). BFCL spells JSON-schema types its own
way ("dict", "float", "tuple", "any"); `to_openai_tool` rewrites them to JSON Schema.

Split: ids whose number % 5 == 0 are held out (never used for draft training).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["bfcl_dir", "load_bfcl", "to_openai_tool"]

_TYPES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer", "bool": "boolean",
          "str": "string", "list": "array"}


def bfcl_dir(path: str | os.PathLike | None = None) -> Path:
    """Folder with the BFCL files: `path`, else `$TOKENSPEED_BFCL`, else the copy shipped with the package.

    Raises:
        FileNotFoundError: none of them holds BFCL_v4_simple_python.json (the message lists where it looked).
    """
    candidates = [Path(p) for p in (path, os.environ.get("TOKENSPEED_BFCL")) if p]
    candidates.append(Path(__file__).resolve().parent / "data" / "bfcl")
    for c in candidates:
        if (c / "BFCL_v4_simple_python.json").is_file():
            return c
    raise FileNotFoundError(f"BFCL data not found in {[str(c) for c in candidates]}; pass a folder or set TOKENSPEED_BFCL")


def _convert(schema):
    if isinstance(schema, dict):
        out = {k: _convert(v) for k, v in schema.items()}
        t = out.get("type")
        if t == "any":
            out.pop("type")
        elif isinstance(t, str) and t in _TYPES:
            out["type"] = _TYPES[t]
        if out.get("type") == "array" and "items" not in out:
            out["items"] = {}
        return out
    if isinstance(schema, list):
        return [_convert(v) for v in schema]
    return schema


def to_openai_tool(function: dict) -> dict:
    """A BFCL function definition as an OpenAI tool ({"type": "function", "function": {...}}).

    Function names keep their dots (e.g. "math.factorial").
    """
    fn = dict(function)
    fn["parameters"] = _convert(fn.get("parameters", {"type": "dict", "properties": {}}))
    return {"type": "function", "function": fn}


def load_bfcl(split: str = "all", path: Path | None = None) -> list[dict]:
    """Load BFCL simple_python cases.

    Args:
        split: "train" (id % 5 != 0), "heldout" (id % 5 == 0) or "all".
        path: folder with the BFCL files (default `bfcl_dir()`).
    Returns:
        [{"id": str, "messages": [{"role", "content"}], "tools": [OpenAI tool], "answer": dict | None}]
    Raises:
        ValueError: unknown split; FileNotFoundError: data missing.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be train, heldout or all, got {split!r}")
    folder = path or bfcl_dir()
    answers = {}
    answer_file = folder / "possible_answer_BFCL_v4_simple_python.json"
    if answer_file.is_file():
        for line in answer_file.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                answers[rec["id"]] = rec.get("ground_truth")
    cases = []
    for line in (folder / "BFCL_v4_simple_python.json").read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        heldout = int(rec["id"].rsplit("_", 1)[1]) % 5 == 0
        if split == "all" or (split == "heldout") == heldout:
            cases.append({"id": rec["id"], "messages": rec["question"][0],
                          "tools": [to_openai_tool(f) for f in rec["function"]], "answer": answers.get(rec["id"])})
    return cases
