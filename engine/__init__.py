"""TokenSpeed: a single-stream, low-latency LLM engine for agents that act.

Quick start::

    import tokenspeed
    engine = tokenspeed.Engine.load()                      # embedded SmolLM2-135M-Instruct
    session = engine.session(system="You control a robot arm.", tools=tools)
    session.observe("The red cube is at x=0.42 y=-0.10.")  # prefilled now
    decision = session.decide(deadline=0.5)                # seconds
    decision.tool_call  # {"name": "pick", "arguments": {"object": "red_cube"}}
"""
from .grammar import ToolSchemaError
from .model import ModelArgs, Transformer
from .engine import Engine, EngineArgumentError, LoadStages
from .session import Checkpoint, Decision, Segment, Session, SessionAborted, SessionArgumentError
from .speculation import SpecConfig
from .device import DeviceError
from .weights import ModelLoadError

__all__ = ["Engine", "LoadStages", "Session", "Decision", "Checkpoint", "Segment", "ModelArgs", "Transformer",
           "SpecConfig", "ToolSchemaError", "ModelLoadError", "DeviceError", "SessionArgumentError", "SessionAborted",
           "EngineArgumentError"]
