"""Tool sets as engine data, and the one reader of tool files.

`TOOLS_DIR` holds the OpenAI tool lists of the project's agents (`robot_tools.json`: the robot
arm; `trading_tools.json`: the trading agent), shipped with the engine so that its benchmark and
draft recipe read them without the ROS package; the ROS nodes and the simulator use the same files.
`load_tools(path)` reads any tool file (the CLI's `--tools`, a node's `tools_file`, the draft data).
"""
from __future__ import annotations

import json
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent / "data" / "tools"


class ToolsFileError(ValueError):
    """A tool file is missing or is not a JSON list of OpenAI function tools; the message names it."""


def load_tools(path: str | Path) -> list[dict]:
    """Read an OpenAI tool list: a JSON array of {"type": "function", "function": {"name", ...}}.

    Returns the list as written (`grammar.normalize_tools` validates the schemas). Raises
    ToolsFileError naming the file when it cannot be read, is not JSON, or is not such a list.
    """
    try:
        tools = json.loads(Path(path).read_text())
    except OSError as e:
        raise ToolsFileError(f"tools file {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ToolsFileError(f"tools file {path} is not valid JSON: {e}") from None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"] for t in tools):
        raise ToolsFileError(f"tools file {path}: expected a JSON list of OpenAI function tools")
    return tools


def tool_set(name: str) -> list[dict]:
    """A shipped tool set by name: "robot" or "trading" (TOOLS_DIR/<name>_tools.json)."""
    return load_tools(TOOLS_DIR / f"{name}_tools.json")
