"""LangChain chat model over an in-process TokenSpeed engine (no HTTP on this path).

    from tokenspeed.integrations.langchain import ChatTokenSpeed
    llm = ChatTokenSpeed()                        # embedded SmolLM2-135M-Instruct
    llm.bind_tools([pick]).invoke("Pick up the red cube.").tool_calls

Requests go through `tokenspeed.chat.ChatEngine`, the same code `tokenspeed serve` answers
with: tool calls under the grammar (every tool_choice), structured output (function calling,
JSON schema or JSON mode), streaming, stop sequences, and warm sessions (a conversation that is
resent with one more message prefills only that message).

Source: LangChain `BaseChatModel` contract (langchain-core) and its standard tests (langchain-tests).
"""
from __future__ import annotations

import functools
import json
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ..chat import ChatEngine

__all__ = ["ChatTokenSpeed"]


@functools.lru_cache(maxsize=4)
def _shared_chat(model: str | None, quantize: str | None, threads: int | None, context: int,
                 cache_budget_mb: float) -> ChatEngine:
    # One resident engine per model setting in a process: chat models are cheap to create
    # (LangChain makes many), engines are not.
    from ..engine import Engine

    engine = Engine.load(model, threads=threads, quantize=quantize)
    return ChatEngine(engine, context, int(cache_budget_mb * (1 << 20)))


class ChatTokenSpeed(BaseChatModel):
    """A LangChain chat model answered by a TokenSpeed engine in this process.

    Attributes:
        model: None for the embedded SmolLM2-135M-Instruct, a `.gguf` file, a safetensors folder
            or "tiny-random".
        quantize: "auto" (default: the measured fastest format, see `Engine.load`), "gguf" (a .gguf
            model's own blocks), "int4", "int8" or None (fp32 weights).
        threads: torch threads (None: torch's choice).
        max_tokens: most tokens per answer.
        temperature, top_p, seed: sampling (temperature 0: greedy).
        stop: stop sequences (the answer ends before the first one).
        deadline: seconds per answer; a late answer has finish_reason "length" and no call
            (response_metadata "tokenspeed_finish": {"reason": "deadline", "detail": why}).
        context: KV capacity per conversation, tokens.
        cache_budget_mb: KV memory the warm conversations may hold, MiB.
        streaming: `invoke` streams through `_stream` (LangChain's flag).
    Engines are shared per (model, quantize, threads, context, cache_budget_mb) in a process.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    model: str | None = None
    quantize: str | None = "auto"
    threads: int | None = None
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    deadline: float | None = Field(default=None, gt=0)
    context: int = Field(default=4096, ge=64)
    cache_budget_mb: float = Field(default=512.0, gt=0)
    streaming: bool = False
    _chat: ChatEngine | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "tokenspeed"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model or "SmolLM2-135M-Instruct", "quantize": self.quantize,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}

    @property
    def model_name(self) -> str:
        return f"tokenspeed:{self.model or 'SmolLM2-135M-Instruct'}"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(ls_provider="tokenspeed", ls_model_name=kwargs.get("model") or self.model_name, ls_model_type="chat",
                      ls_temperature=self.temperature, ls_max_tokens=self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    @property
    def chat(self) -> ChatEngine:
        """The `ChatEngine` answering this model's requests (loaded on first use)."""
        if self._chat is None:
            self._chat = _shared_chat(self.model, self.quantize, self.threads, self.context, self.cache_budget_mb)
        return self._chat

    # ---------------------------------------------------------------- tools and structured output

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | dict | bool | None = None, parallel_tool_calls: bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (dicts, Pydantic models, functions or LangChain tools) as OpenAI tools.

        tool_choice: "auto", "none", "any"/"required"/True (a call to some tool), a tool name, or
        an OpenAI tool_choice dict. parallel_tool_calls: several calls per answer (default True).
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice in ("any", True):
            tool_choice = "required"
        elif isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict | type, *, method: str = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Answers parsed into `schema` (a Pydantic v2 or v1 class, TypedDict or JSON schema).

        method: "json_schema" (the answer is JSON under the schema's grammar; default; "json_mode"
        is the same: the schema's grammar, not merely any JSON object) or "function_calling" (a
        forced call to a tool made from the schema). strict is accepted for API compatibility:
        the grammar always enforces the schema.
        """
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)   # pydantic v2 or v1
        js = convert_to_json_schema(schema)  # json_mode too: the grammar of the schema, not just any object
        fmt = {"type": "json_schema", "json_schema": {"name": js.get("title", "answer"), "schema": js}}
        llm = self.bind(response_format=fmt, ls_structured_output_format={"kwargs": {"method": method},
                                                                          "schema": schema})
        parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        return RunnableMap(raw=llm) | parsed

    # ---------------------------------------------------------------- generation

    def _job(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> dict:
        request = {"messages": convert_to_openai_messages(messages), "max_tokens": self.max_tokens,
                   "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                   "stop": stop if stop is not None else self.stop}
        for key in ("tools", "tool_choice", "parallel_tool_calls", "response_format", "max_tokens", "temperature",
                    "top_p", "seed", "auto_threshold"):
            if kwargs.get(key) is not None:
                request[key] = kwargs[key]
        return self.chat.prepare(request)

    def _deadline_at(self) -> float | None:
        return time.monotonic() + self.deadline if self.deadline else None

    def _message_parts(self, result) -> tuple[dict, UsageMetadata, dict]:
        msg = result.message
        tool_calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]), "id": c["id"],
                       "type": "tool_call"} for c in msg.get("tool_calls") or ()]
        u = result.usage
        usage = UsageMetadata(input_tokens=u["prompt_tokens"], output_tokens=u["completion_tokens"],
                              total_tokens=u["total_tokens"],
                              input_token_details={"cache_read": u["prompt_tokens_details"]["cached_tokens"]})
        meta = {"finish_reason": result.finish_reason, "model_name": self.model_name,
                "model_provider": "tokenspeed", "tokenspeed": result.timings, "tokenspeed_finish": result.detail}
        return {"content": msg.get("content") or "", "tool_calls": tool_calls}, usage, meta

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        """Answer `messages` (see `tokenspeed.chat.ChatEngine.complete`).

        Raises:
            tokenspeed.chat.ChatError: a request field is invalid (the message names it).
        """
        job = self._job(messages, stop, kwargs)
        result = self.chat.complete(job, self._deadline_at())
        parts, usage, meta = self._message_parts(result)
        message = AIMessage(content=parts["content"], tool_calls=parts["tool_calls"], usage_metadata=usage,
                            response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": result.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """Stream a text answer piece by piece; calls arrive whole in the last chunk."""
        job = self._job(messages, stop, kwargs)
        pieces: queue.Queue = queue.Queue()
        box: dict = {}

        def work() -> None:
            try:
                box["result"] = self.chat.complete(job, self._deadline_at(), on_text=pieces.put)
            except BaseException as exc:  # re-raised on the caller's thread
                box["error"] = exc
            finally:
                pieces.put(None)

        worker = threading.Thread(target=work, name="tokenspeed-langchain", daemon=True)
        worker.start()
        while (piece := pieces.get()) is not None:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        worker.join()
        if "error" in box:
            raise box["error"]
        result = box["result"]
        parts, usage, meta = self._message_parts(result)
        chunks = [{"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i, "type": "tool_call_chunk"}
                  for i, c in enumerate(parts["tool_calls"])]
        yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=chunks, usage_metadata=usage,
                                                         response_metadata=meta, chunk_position="last"),
                                  generation_info={"finish_reason": result.finish_reason})
