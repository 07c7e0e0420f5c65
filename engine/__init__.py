"""TokenSpeed: a single-stream, low-latency LLM engine for agents that act.

Quick start::

    import tokenspeed
    engine = tokenspeed.Engine.load()                      # embedded SmolLM2-135M-Instruct
    session = engine.session(system="You control a robot arm.", tools=tools)
    session.observe("The red cube is at x=0.42 y=-0.10.")  # prefilled now
    decision = session.decide(deadline=0.5)                # seconds
    decision.tool_call  # {"name": "pick", "arguments": {"object": "red_cube"}}

The names below are imported on first use (PEP 562), so that `import tokenspeed.tools` (the tool
sets and their reader) does not import torch: the simulator reads the tool files without it.
"""
from __future__ import annotations

import importlib

_EXPORTS = {   # public name -> the submodule that defines it
    "Engine": "engine", "EngineArgumentError": "engine", "LoadStages": "stages",
    "Session": "session", "Decision": "session", "Checkpoint": "session", "Segment": "session",
    "SessionAborted": "session", "SessionArgumentError": "session",
    "ModelArgs": "model", "Transformer": "model", "SpecConfig": "speculation", "ToolSchemaError": "grammar",
    "ModelLoadError": "weights", "DeviceError": "device",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokenspeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
