"""`tokenspeed draft build-data`: agent action sequences answered by the target (self-distillation).

Tasks come from three tool sets: the robot arm (`tokenspeed/data/tools/robot_tools.json`), the trading
agent (`tokenspeed/data/tools/trading_tools.json`), each with seeded observation templates in the
formats the ROS nodes send, and the BFCL simple_python functions with their own questions.
Every task is split deterministically: robot/trading task index % 5 == 0 and BFCL id number
% 5 == 0 are held out (never trained on).

Agent sessions ("agent" family, `agent_workloads`): whole multi-call agent turns in the AAL
benchmark's format (`tokenspeed.bench.workload`: sensor streams, tool results and requests
growing a 2K-4K-token context; the target's own earlier calls stay in it), one row per decision.
Seeds 1.. are used (the benchmark runs seed 0); seed % 5 == 0 is held out; their BFCL functions
exclude the benchmark workloads' and the held-out split's, so nothing the benchmark or
`draft eval` asks was trained on.

Each task is answered by the target model itself through `Session.decide()` (greedy,
grammar-constrained), so the draft learns exactly the target's choices (DistillSpec, Zhou et al.
2024). The dataset file is JSON lines: a header {"format", "target", "model"} then one row per
successful call with the conversation (system, tools, messages), the exact token ids
(`prompt_ids` = context up to and including the assistant trigger, `output_ids` = the call) and
`forced` (1 where the grammar forced the token by jump-forward).
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from tokenspeed.tools import TOOLS_DIR, load_tools

if TYPE_CHECKING:
    from tokenspeed.bench.workload import Workload

__all__ = ["Task", "robot_tasks", "trading_tasks", "bfcl_tasks", "agent_workloads", "build_data", "read_data",
           "forced_mask", "FORMAT"]

FORMAT = "tokenspeed-draft-data/1"
ROBOT_SYSTEM = ("You control a Franka Panda robot arm above a table with a red, a green and a blue cube. "
                "Observations give joint angles (radians) and cube positions (x forward, y left, metres, "
                "robot base frame). Reply with exactly one tool call that moves the task forward.")
TRADING_SYSTEM = ("You trade one crypto pair. Each observation summarises its order book and recent trades "
                  "(prices in USD, sizes in BTC, bp = basis point). Reply with exactly one tool call: "
                  "place_order to trade, cancel_order to pull resting orders, or hold to do nothing.")


@dataclass
class Task:
    """One decision to distil: a conversation the target answers with one tool call.

    Attributes: id (unique str), family ("robot" | "trading" | "bfcl"), split ("train" |
    "heldout"), system (str or None), tools (OpenAI tool dicts), messages (user texts, observed
    in order before the decision).
    """

    id: str
    family: str
    split: str
    system: str | None
    tools: list
    messages: list


def _split(i: int) -> str:
    return "heldout" if i % 5 == 0 else "train"


def robot_tasks(n: int, seed: int = 0, tools_path: Path = TOOLS_DIR / "robot_tools.json") -> list[Task]:
    """n seeded robot-arm decisions: joint states, cube positions and an instruction."""
    tools = load_tools(tools_path)
    rng = random.Random(seed)
    cubes = ["red_cube", "green_cube", "blue_cube"]
    out = []
    for i in range(n):
        pos = {c: (rng.uniform(0.32, 0.68), rng.uniform(-0.28, 0.28)) for c in cubes}
        q = [rng.uniform(-2.5, 2.5) for _ in range(7)]
        joints = "joints q=[" + ",".join(f"{v:.2f}" for v in q) + "] (rad)"
        seen = "objects " + " ".join(f"{c}=({x:.2f},{y:.2f})" for c, (x, y) in sorted(pos.items()))
        c = rng.choice(cubes)
        x, y, z = rng.uniform(0.3, 0.7), rng.uniform(-0.3, 0.3), rng.uniform(0.05, 0.5)
        colour = c.split("_")[0]
        instruction = rng.choice([
            f"Pick up the {colour} cube.", f"Grasp the {colour} cube.", f"Task: pick the {colour} cube.",
            f"Place the held cube at x={x:.2f} y={y:.2f}.", f"Put the cube down at x={x:.2f}, y={y:.2f}.",
            f"Move the gripper to x={x:.2f}, y={y:.2f}, z={z:.2f}.",
            f"Move above x={x:.2f} y={y:.2f} at height z={z:.2f}.",
            f"The {colour} cube is at x={pos[c][0]:.2f} y={pos[c][1]:.2f}. Pick it up.",
            "A person entered the cell. Stop all motion.", "Wait: keep the arm where it is.",
            f"Stack: place the held cube on the {colour} cube at x={pos[c][0]:.2f} y={pos[c][1]:.2f}.",
        ])
        messages = [f"{joints}. {seen}", instruction] if rng.random() < 0.5 else [f"{seen}. {instruction}"]
        out.append(Task(f"robot_{i}", "robot", _split(i), ROBOT_SYSTEM, tools, messages))
    return out


def trading_tasks(n: int, seed: int = 0, tools_path: Path = TOOLS_DIR / "trading_tools.json") -> list[Task]:
    """n seeded market observations in the market bridge's observation format."""
    tools = load_tools(tools_path)
    rng = random.Random(seed + 1)
    out = []
    for i in range(n):
        mid = rng.uniform(20000, 100000)
        spread = rng.choice([0.01, 0.5, 1.0, 2.5, 8.0])
        move = rng.uniform(-30, 30)
        trades = ", ".join(f"{rng.choice(['buy', 'sell'])} {rng.uniform(0.0005, 0.3):.4f}@{mid + rng.uniform(-5, 5):.2f}"
                           for _ in range(rng.randint(0, 5))) or "none"
        reason = rng.choice(["price_move", "trade_burst", "timer"])
        obs = (f"BITSTAMP BTC-USD {reason}: mid {mid:.2f} ({move:+.1f} bp), spread {spread:.2f} "
               f"({spread / mid * 1e4:.1f} bp), imbalance {rng.uniform(-1, 1):+.2f}, volatility "
               f"{rng.uniform(0, 40):.1f} bp, last trades {trades}")
        hint = rng.choice(["", "", " Buy 0.01 BTC at market.", " Sell 0.02 with a limit 5 bp above mid.",
                           " Cancel all resting orders.", " Nothing to do now.", " Buy 0.005 BTC, limit -3 bp."])
        out.append(Task(f"trading_{i}", "trading", _split(i), TRADING_SYSTEM, tools, [obs + hint]))
    return out


def bfcl_tasks(folder: Path | None = None, limit: int | None = None) -> list[Task]:
    """BFCL simple_python questions with their functions (`tokenspeed.bfcl`, same held-out split)."""
    from ..bfcl import load_bfcl

    out = []
    for case in load_bfcl("all", Path(folder) if folder else None)[:limit]:
        number = int(case["id"].rsplit("_", 1)[1])
        messages = [m["content"] for m in case["messages"] if m["role"] == "user"]
        out.append(Task(case["id"], "bfcl", _split(number), None, case["tools"], messages))
    return out


def agent_workloads(n: int, seed: int = 0, n_calls: int = 10) -> list[tuple[str, str, Workload]]:
    """n AAL-format agent sessions of n_calls decisions as (id prefix, split, `Workload`), seeds
    seed + 1 .. seed + n; seed 0 is the benchmark's and never generated here."""
    from ..bench.workload import build_workload
    from ..bfcl import load_bfcl

    exclude = {c["id"] for c in load_bfcl("heldout")}
    for bench in (build_workload(seed=0), build_workload(seed=0, quick=True)):
        exclude |= {t.tool_choice["name"] for t in bench.turns if isinstance(t.tool_choice, dict)}
    out = []
    for s in range(seed + 1, seed + n + 1):
        wl = build_workload(seed=s, n_calls=n_calls, bfcl_exclude=frozenset(exclude))
        out.append((f"agent_{s}", _split(s), wl))
    return out


def forced_mask(matcher, output_ids: list[int]) -> list[int]:
    """1 for each output token the grammar forced (jump-forward), replaying `decide()`'s order."""
    forced = [0] * len(output_ids)
    i = 0
    while i < len(output_ids):
        ff = matcher.compute_ff_tokens()
        if ff and output_ids[i:i + len(ff)] == ff:
            matcher.consume_tokens(ff)
            forced[i:i + len(ff)] = [1] * len(ff)
            i += len(ff)
            continue
        matcher.consume_token(output_ids[i])
        i += 1
    return forced


def build_data(engine, tasks: list[Task], out: Path, max_tokens: int = 128, resume: bool = False,
               workloads: list[tuple] = ()) -> dict:
    """Answer every task with the target and write the dataset (JSON lines) to `out`.

    Tasks sharing a system prompt and tools share one session (its prefill is reused through
    checkpoint/rollback). Tasks whose decision is not a valid call are skipped and counted; a
    task whose tool schema the engine rejects is skipped and counted.

    workloads: agent sessions from `agent_workloads`, each replayed in one session (observations,
    then the decision, which stays in the context); a row per decision, id "<prefix>_<turn>",
    with its `tool_choice`. A session whose decision fails stops there (the context would differ
    from the agent's).

    resume: keep the rows already in `out` (an interrupted or smaller earlier run for the same
    target) and answer only the tasks whose id is not there yet.

    Returns:
        {"written": {split: rows}, "kept": rows already there, "skipped": n, "path": str}.
    Raises:
        ValueError: resume into a file built for another target model.
    """
    from tokenspeed import ToolSchemaError
    from tokenspeed.speculation import fingerprint

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written, skipped = {"train": 0, "heldout": 0}, 0
    done: set[str] = set()
    if resume and out.is_file():
        header, rows = read_data(out)
        if header["target"] != fingerprint(engine.model):
            raise ValueError(f"{out} was built for another target model ({header['model']})")
        done = {r["id"] for r in rows}
        tasks = [t for t in tasks if t.id not in done]
    trigger = engine.tokenizer.encode(engine.tokenizer.assistant_prefix)  # the chat template's framing
    end = engine.tokenizer.encode(engine.tokenizer.assistant_suffix)
    sessions: dict[str, tuple] = {}

    def write(fields: dict, s, context: list[int], tool_choice, d) -> None:
        """One row: `fields`, then the exact ids of the prompt (context + trigger) and of the call
        that `d` left in session `s`, which tokens the grammar forced, and the call's text."""
        prompt_ids = context + trigger
        output_ids = (s.tokens + s.pending[:len(s.pending) - len(end)])[len(prompt_ids):]
        forced = forced_mask(engine.grammar(s.tools, tool_choice).matcher(), output_ids)
        f.write(json.dumps(dict(fields, prompt_ids=prompt_ids, output_ids=output_ids, forced=forced,
                                text=d.text)) + "\n")
        f.flush()  # an interrupted run leaves a usable file
        written[fields["split"]] += 1

    with out.open("a" if done else "w") as f:
        if not done:
            f.write(json.dumps({"format": FORMAT, "target": fingerprint(engine.model), "model": engine.source}) + "\n")
        for task in tqdm(tasks, desc="build-data", unit="task"):
            key = json.dumps([task.system, task.tools], sort_keys=True)
            try:
                if key not in sessions:
                    if len(sessions) > 4:
                        sessions.clear()
                    s = engine.session(system=task.system, tools=task.tools)
                    sessions[key] = (s, s.checkpoint())
                s, cp = sessions[key]
                s.rollback(cp)
                for m in task.messages:
                    s.observe(m)
                context = list(s.tokens)
                d = s.decide(max_tokens=max_tokens)
            except (ToolSchemaError, ValueError):
                skipped += 1
                continue
            if not d.ok:
                skipped += 1
                continue
            write(asdict(task), s, context, "required", d)
        for prefix, split, wl in tqdm([w for w in workloads if f"{w[0]}_0" not in done], desc="build-data agent",
                                      unit="session"):
            try:
                s = engine.session(system=wl.system, tools=wl.tools)
            except ToolSchemaError:
                skipped += len(wl.turns)
                continue
            for i, turn in enumerate(wl.turns):
                for o in turn.observations:
                    s.observe(o.content, role=o.role, kind=o.kind, source=o.source)
                context = list(s.tokens)
                d = s.decide(tool_choice=turn.tool_choice, max_tokens=wl.max_tokens)
                if not d.ok:
                    skipped += len(wl.turns) - i
                    break
                write({"id": f"{prefix}_{i}", "family": "agent", "split": split, "system": wl.system,
                       "tools": wl.tools, "messages": [o.content for o in turn.observations],
                       "tool_choice": turn.tool_choice}, s, context, turn.tool_choice, d)
    return {"written": written, "kept": len(done), "skipped": skipped, "path": str(out)}


def read_data(path: Path, split: str | None = None) -> tuple[dict, list[dict]]:
    """(header, rows) of a dataset file, rows filtered to `split` when given.

    Raises:
        FileNotFoundError: no file. ValueError: not a draft dataset.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist (run `tokenspeed draft build-data`)")
    try:
        lines = path.read_text().splitlines()
        parsed = [json.loads(line) for line in lines]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a {FORMAT} file (JSON lines): {exc}") from exc
    if not parsed or not all(isinstance(x, dict) for x in parsed) or parsed[0].get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file (a header object, then one object per row)")
    header, rows = parsed[0], parsed[1:]
    return header, [r for r in rows if split is None or r.get("split") == split]
