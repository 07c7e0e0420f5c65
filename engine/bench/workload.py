"""The Agent Action Latency (AAL) workload: one agent turn of tool calls over a growing context.

An agent holds robot-arm tools (`tokenspeed/data/tools/robot_tools.json`), a few trading tools (defined
here) and real, externally written functions from the Berkeley Function Calling Leaderboard
(BFCL v4 simple_python, `tokenspeed/data/bfcl/`). It performs `n_calls` decisions; before each one, new
observations (sensor readings, camera detections, market ticks, the previous call's tool result,
the user's request) enter the context, which grows to ~4K tokens in the full workload.

Everything is generated from a seed (`random.Random(seed)`) and saved as JSON, so every engine
runs exactly the same observations and decision requests. Each engine keeps its own generated
calls in its context (as an agent does); greedy decoding makes those calls identical when the
engines agree.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ..bfcl import bfcl_dir as find_bfcl_dir
from ..tools import tool_set

__all__ = ["Observation", "Turn", "Workload", "build_workload", "bfcl_tool", "TRADING_TOOLS"]

WORKLOAD_VERSION = 1

TRADING_TOOLS = [
    {"type": "function", "function": {
        "name": "place_order",
        "description": "Send a limit order for one listed symbol.",
        "parameters": {"type": "object", "properties": {
            "symbol": {"type": "string", "enum": ["ACME", "GLOBX", "INITECH", "UMBRL"]},
            "side": {"type": "string", "enum": ["buy", "sell"]},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "Shares."},
            "limit_price": {"type": "number", "minimum": 1, "maximum": 1000, "description": "USD per share."}},
            "required": ["symbol", "side", "quantity", "limit_price"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "cancel_orders",
        "description": "Cancel all resting orders of one symbol.",
        "parameters": {"type": "object", "properties": {
            "symbol": {"type": "string", "enum": ["ACME", "GLOBX", "INITECH", "UMBRL"]}},
            "required": ["symbol"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_stop_loss",
        "description": "Sell the whole position of a symbol if its price falls below a trigger.",
        "parameters": {"type": "object", "properties": {
            "symbol": {"type": "string", "enum": ["ACME", "GLOBX", "INITECH", "UMBRL"]},
            "trigger_price": {"type": "number", "minimum": 1, "maximum": 1000, "description": "USD."}},
            "required": ["symbol", "trigger_price"], "additionalProperties": False}}},
]
_SYMBOLS = ["ACME", "GLOBX", "INITECH", "UMBRL"]
_CUBES = ["red_cube", "green_cube", "blue_cube"]
# The kinds of decision in the agent turn, in order (cycled when n_calls > len).
_PLAN = ["pick", "place", "order", "bfcl", "move", "stop_loss", "bfcl", "pick", "cancel", "bfcl"]
_QUICK_PLAN = ["pick", "bfcl", "order"]


@dataclass
class Observation:
    """One chat message entering the context before a decision (role "user" or "tool")."""

    content: str
    role: str = "user"
    kind: str = "text"      # "text" or "sensor"
    source: str = ""


@dataclass
class Turn:
    """One decision: the observations that precede it, the tool_choice, and the expected tool."""

    observations: list[Observation]
    tool_choice: str | dict = "required"
    expect: str = ""


@dataclass
class Workload:
    """A full AAL workload (JSON-serialisable).

    Attributes:
        seed: generator seed; quick: the small variant; system: system prompt (tools are rendered
        after it by each engine's chat formatting); tools: OpenAI tool dicts; turns: the decisions;
        max_tokens: answer budget per decision (tokens); short_prompt: prompt of the short-context
        decode measurement; short_tokens: tokens generated there.
    """

    seed: int
    quick: bool
    system: str
    tools: list[dict]
    turns: list[Turn]
    max_tokens: int = 96
    short_prompt: str = "Write a long story about a robot arm that sorts coloured cubes on a table."
    short_tokens: int = 32
    version: int = WORKLOAD_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the workload as JSON to `path` (parents created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Workload":
        """Read a workload JSON file.

        Raises:
            ValueError: the file is not a workload of this version.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read workload {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("version") != WORKLOAD_VERSION:
            raise ValueError(f"{path} is not an AAL workload of version {WORKLOAD_VERSION}")
        turns = [Turn(observations=[Observation(**o) for o in t["observations"]], tool_choice=t["tool_choice"],
                      expect=t.get("expect", "")) for t in data.pop("turns")]
        return cls(turns=turns, **data)


_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "integer": "integer", "string": "string",
               "boolean": "boolean", "number": "number", "array": "array", "object": "object"}


def _bounded(schema: dict) -> dict:
    """BFCL's schema dialect -> JSON schema with bounds (a 135M model can loop on unbounded digits)."""
    out = {k: v for k, v in schema.items() if k not in ("type", "properties", "items", "default", "optional")}
    t = _BFCL_TYPES.get(schema.get("type"))
    if t:
        out["type"] = t
    if t == "integer":
        out.setdefault("minimum", -1_000_000)
        out.setdefault("maximum", 1_000_000)
    elif t == "number":
        out.setdefault("minimum", -1e6)
        out.setdefault("maximum", 1e6)
    elif t == "string" and "enum" not in out:
        out.setdefault("maxLength", 48)
    elif t == "array":
        out["items"] = _bounded(schema.get("items", {"type": "string"}))
        out.setdefault("maxItems", 8)
    elif t == "object":
        out["properties"] = {k: _bounded(v) for k, v in schema.get("properties", {}).items()}
        out["additionalProperties"] = False
    return out


def bfcl_tool(function: dict) -> dict:
    """One BFCL function -> an OpenAI tool dict with a bounded JSON schema."""
    params = _bounded(dict(function["parameters"], type="object"))
    params["required"] = [r for r in function["parameters"].get("required", []) if r in params["properties"]]
    return {"type": "function", "function": {"name": function["name"], "description": function.get("description", ""),
                                             "parameters": params}}


def _bfcl_entries(folder: Path, rng: random.Random, count: int, exclude=frozenset()) -> list[dict]:
    # Functions whose parameters are all scalars (no free-form objects), few of them; neither their
    # case id nor their name in `exclude`.
    simple = []
    with open(folder / "BFCL_v4_simple_python.json") as f:
        for line in f:
            entry = json.loads(line)
            props = entry["function"][0]["parameters"].get("properties", {})
            if exclude & {entry["id"], entry["function"][0]["name"]}:
                continue
            if 1 <= len(props) <= 3 and all(p.get("type") in ("integer", "string", "float", "boolean")
                                            for p in props.values()):
                simple.append(entry)
    picked = rng.sample(simple, count)
    names = [e["function"][0]["name"] for e in picked]
    while len(set(names)) < count:  # BFCL reuses some names; a tool set needs distinct ones
        i = next(i for i, n in enumerate(names) if n in names[:i])
        picked[i] = rng.choice(simple)
        names[i] = picked[i]["function"][0]["name"]
    return picked


def _robot_tools() -> list[dict]:
    return tool_set("robot")


def _joint_states(rng: random.Random, t: float) -> Observation:
    q = ", ".join(f"{rng.uniform(-2.5, 2.5):.2f}" for _ in range(7))
    return Observation(f"[t={t:.2f}s joint_states] q=[{q}] gripper={rng.uniform(0, 0.08):.3f}",
                       kind="sensor", source="joint_states")


def _detections(rng: random.Random, t: float, cubes: dict) -> Observation:
    items = "; ".join(f"{c} x={x:.2f} y={y:.2f} conf={rng.uniform(0.8, 0.99):.2f}"
                      for c, (x, y) in cubes.items())
    return Observation(f"[t={t:.2f}s camera] detections: {items}", kind="sensor", source="camera")


def _ticks(rng: random.Random, t: float, prices: dict, n: int) -> Observation:
    lines = []
    for i in range(n):
        s = rng.choice(_SYMBOLS)
        prices[s] = round(prices[s] * (1 + rng.uniform(-0.002, 0.002)), 2)
        lines.append(f"{s} bid={prices[s] - 0.01:.2f} ask={prices[s] + 0.01:.2f}")
    return Observation("[market ticks]\n" + "\n".join(lines), kind="sensor", source="market")


def build_workload(seed: int = 0, quick: bool = False, n_calls: int | None = None,
                   bfcl_dir: str | os.PathLike | None = None, bfcl_exclude=frozenset()) -> Workload:
    """Generate the AAL workload deterministically from `seed`.

    Args:
        seed: RNG seed (same seed -> byte-identical workload).
        quick: small variant (2 calls, ~1.2K-token context, 1 BFCL function) for tests.
        n_calls: number of decisions (default 10, quick 2).
        bfcl_dir: BFCL data folder (see `tokenspeed.bfcl.bfcl_dir`).
        bfcl_exclude: BFCL case ids or function names not to use (the draft's training
            workloads exclude the benchmark's functions and the held-out split).
    Raises:
        FileNotFoundError: BFCL data or the robot tool set not found.
        ValueError: n_calls < 1.
    """
    n_calls = n_calls if n_calls is not None else (2 if quick else 10)
    plan = _QUICK_PLAN if quick else _PLAN
    if n_calls < 1:
        raise ValueError(f"n_calls must be >= 1, got {n_calls}")
    rng = random.Random(seed)
    bfcl = _bfcl_entries(find_bfcl_dir(bfcl_dir), rng, 1 if quick else 5, bfcl_exclude)
    tools = _robot_tools() + (TRADING_TOOLS[:1] if quick else TRADING_TOOLS) + [bfcl_tool(e["function"][0]) for e in bfcl]
    system = ("You are the controller of a Franka Panda robot arm in a work cell and a trading assistant "
              "for a small desk; you also answer general requests with the listed functions. Positions "
              "are metres in the robot base frame. Every answer is exactly one tool call.")
    cubes = {c: (round(rng.uniform(0.35, 0.65), 3), round(rng.uniform(-0.25, 0.25), 3)) for c in _CUBES}
    prices = {s: round(rng.uniform(20, 400), 2) for s in _SYMBOLS}
    n_ticks = 2 if quick else 4
    t, held, bfcl_i, turns = 0.0, None, 0, []
    for i in range(n_calls):
        kind = plan[i % len(plan)]
        t += rng.uniform(0.5, 2.0)
        obs = []
        if turns:
            obs.append(Observation(json.dumps({"result": "ok", "t": round(t, 2)}), role="tool", source="tool_result"))
        obs.append(_joint_states(rng, t))
        if kind in ("pick", "place", "move"):
            obs.append(_detections(rng, t, cubes))
        elif kind in ("order", "stop_loss", "cancel"):
            obs.append(_ticks(rng, t, prices, n_ticks))
        choice, expect = "required", kind
        if kind == "pick":
            held = rng.choice([c for c in _CUBES if c != held])
            x, y = cubes[held]
            request, expect = f"The {held.replace('_', ' ')} is at x={x:.2f} y={y:.2f}. Pick up the {held.replace('_', ' ')}.", "pick"
        elif kind == "place":
            x, y = round(rng.uniform(0.35, 0.65), 2), round(rng.uniform(-0.25, 0.25), 2)
            request, expect = f"Place the cube you hold at x={x} y={y}.", "place"
        elif kind == "move":
            x, y, z = round(rng.uniform(0.35, 0.65), 2), round(rng.uniform(-0.25, 0.25), 2), round(rng.uniform(0.1, 0.4), 2)
            request, expect = f"Move the gripper to x={x} y={y} z={z}.", "move_to"
        elif kind == "order":
            s = rng.choice(_SYMBOLS)
            request = f"Buy {rng.randint(1, 20) * 10} shares of {s} with a limit price of {prices[s]:.2f} USD."
            expect = "place_order"
        elif kind == "stop_loss":
            s = rng.choice(_SYMBOLS)
            request = f"Protect the {s} position: set a stop loss at {prices[s] * 0.95:.2f} USD."
            expect = "set_stop_loss"
        elif kind == "cancel":
            s = rng.choice(_SYMBOLS)
            request, expect = f"Cancel all resting {s} orders now.", "cancel_orders"
        else:  # a BFCL question, answered with its own function (named tool_choice, as in BFCL)
            entry = bfcl[bfcl_i % len(bfcl)]
            bfcl_i += 1
            request = entry["question"][0][-1]["content"]
            expect = entry["function"][0]["name"]
            choice = {"name": expect}
        obs.append(Observation(request, source="operator"))
        turns.append(Turn(observations=obs, tool_choice=choice, expect=expect))
    return Workload(seed=seed, quick=quick, system=system, tools=tools, turns=turns,
                    max_tokens=64 if quick else 96, short_tokens=8 if quick else 32)
