"""System prompt KV on disk (tokenspeed.prefix_cache): a warm session reads the prefilled system
prompt and tools instead of prefilling them, and equals a freshly prefilled one; any change of
prompt, tools or model misses."""
import pytest
import torch

from tokenspeed.prefix_cache import PREFIX_ENV

SYSTEM = "You control a robot arm on a table. Act with one tool call."


@pytest.fixture
def prefix_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(PREFIX_ENV, str(tmp_path))
    return tmp_path


def _next_logits(session, text):
    ids = session._render([{"role": "user", "content": text}]) + session.tok.encode(session.tok.assistant_prefix)
    return session.target.forward(session.pending + ids, "last")


@pytest.mark.parametrize("kv_budget", [None, 512])
def test_restored_session_equals_freshly_prefilled_one(engine, robot_tools, prefix_dir, kv_budget):
    fresh = engine.session(system=SYSTEM, tools=robot_tools[:2], kv_budget=kv_budget)
    assert not fresh.system_from_disk and len(list(prefix_dir.glob("*.safetensors"))) == 1
    warm = engine.session(system=SYSTEM, tools=robot_tools[:2], kv_budget=kv_budget)
    assert warm.system_from_disk
    assert warm.tokens == fresh.tokens and warm.pending == fresh.pending and warm.num_tokens == fresh.num_tokens
    n = fresh.cache.n
    assert warm.cache.n == n and warm.cache.next_position() == fresh.cache.next_position()
    for name in ("k", "v"):
        assert torch.equal(getattr(warm.cache, name)[:, :, :, :n], getattr(fresh.cache, name)[:, :, :, :n])
    assert torch.equal(warm.cache.pos[:n], fresh.cache.pos[:n])
    if kv_budget:
        assert torch.equal(warm.cache.score[:n], fresh.cache.score[:n])
    # the draft model's KV of the same tokens comes from the entry too (none is prefilled)
    wd, fd = warm.speculator.draft, fresh.speculator.draft
    m = fd.cache.n
    assert m == len(fresh.tokens) and wd.cache.n == m and wd.cache.next_position() == fd.cache.next_position()
    for name in ("k", "v"):
        assert torch.equal(getattr(wd.cache, name)[:, :, :, :m], getattr(fd.cache, name)[:, :, :, :m])
    assert torch.equal(wd.cache.pos[:m], fd.cache.pos[:m]) and (wd.tokens[:m] == fd.tokens[:m]).all()
    assert torch.equal(_next_logits(warm, "Pick up the red cube."), _next_logits(fresh, "Pick up the red cube."))
    texts = []
    for s in (fresh, warm):
        s.observe("The blue cylinder is at x=0.30 y=0.25. Place the cube next to it.")
        texts.append(s.decide().text)
    assert texts[0] == texts[1]


def test_changed_prompt_tools_or_model_misses(engine, tiny_engine, robot_tools, prefix_dir):
    assert not engine.session(system=SYSTEM, tools=robot_tools[:2]).system_from_disk
    assert engine.session(system=SYSTEM, tools=robot_tools[:2]).system_from_disk
    assert not engine.session(system=SYSTEM + " Be brief.", tools=robot_tools[:2]).system_from_disk
    assert not engine.session(system=SYSTEM, tools=robot_tools[:1]).system_from_disk
    assert not tiny_engine.session(system=SYSTEM, tools=robot_tools[:2]).system_from_disk  # another model
    assert len(list(prefix_dir.glob("*.safetensors"))) == 4


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_entry_is_a_miss_and_is_replaced(engine, robot_tools, prefix_dir, damage):
    fresh = engine.session(system=SYSTEM, tools=robot_tools[:2])
    (entry,) = prefix_dir.glob("*.safetensors")
    data = entry.read_bytes()
    # a truncated entry fails while its KV is read into the cache: the session prefills it all the same
    entry.write_bytes(b"not a safetensors file" if damage == "garbage" else data[:len(data) // 2])
    s = engine.session(system=SYSTEM, tools=robot_tools[:2])
    assert not s.system_from_disk and s.cache.n == fresh.cache.n
    n = s.cache.n
    assert torch.equal(s.cache.k[:, :, :, :n], fresh.cache.k[:, :, :, :n])
    assert engine.session(system=SYSTEM, tools=robot_tools[:2]).system_from_disk


def test_off_writes_nothing(tiny_engine, prefix_dir, monkeypatch):
    monkeypatch.setenv(PREFIX_ENV, "off")
    assert not tiny_engine.session(system=SYSTEM).system_from_disk
    assert not tiny_engine.session(system=SYSTEM).system_from_disk
    assert not list(prefix_dir.iterdir())


def test_an_entry_of_another_kv_dtype_is_never_read(engine, robot_tools, prefix_dir, monkeypatch):
    # the KV dtype is part of the key: an fp32-KV entry (an fp32 cache's, or one written before the CPU
    # cache became fp16) misses for the fp16 cache; put under the fp16 entry's name, it is refused
    # (the dtypes differ), prefilled and replaced, never read as fp16
    from tokenspeed.model import Transformer

    with monkeypatch.context() as m:
        m.setattr(Transformer, "kv_dtype", property(lambda self: torch.float32))
        old = engine.session(system=SYSTEM, tools=robot_tools[:2])
    assert not old.system_from_disk and old.cache.k.dtype == torch.float32
    (fp32_entry,) = prefix_dir.glob("*.safetensors")
    s = engine.session(system=SYSTEM, tools=robot_tools[:2])
    assert not s.system_from_disk and s.cache.k.dtype == engine.model.kv_dtype == torch.float16
    (entry,) = set(prefix_dir.glob("*.safetensors")) - {fp32_entry}
    entry.write_bytes(fp32_entry.read_bytes())
    again = engine.session(system=SYSTEM, tools=robot_tools[:2])
    n = s.cache.n
    assert not again.system_from_disk and again.cache.n == n
    assert torch.equal(again.cache.k[:, :, :, :n], s.cache.k[:, :, :, :n])
    assert engine.session(system=SYSTEM, tools=robot_tools[:2]).system_from_disk


def test_the_most_recently_used_entries_stay_within_the_count_and_bytes(tiny_engine, prefix_dir, monkeypatch):
    import time

    from tokenspeed import prefix_cache

    def entry(system):      # a session's entry, written now (mtimes one tick apart)
        time.sleep(0.02)
        return tiny_engine.session(system=system).system_from_disk

    monkeypatch.setattr(prefix_cache, "KEEP", 2)
    entry("a")
    entry("b")
    assert entry("a")                                   # a hit: "a" is now the most recently used
    entry("c")                                          # evicts "b", the least recently used
    assert len(list(prefix_dir.glob("*.safetensors"))) == 2
    assert entry("a") and entry("c") and not entry("b")
    monkeypatch.setattr(prefix_cache, "KEEP_BYTES", 1)  # fewer bytes than any entry: the newest stays alone
    entry("d")
    assert len(list(prefix_dir.glob("*.safetensors"))) == 1 and entry("d")


def test_chat_usage_counts_the_system_prompt_read_from_disk(engine, robot_tools, prefix_dir):
    # a conversation no warm session holds, whose system prompt and tools are on disk: the usage an
    # OpenAI client reads says those tokens were cached, and the prefill count leaves them out
    from tokenspeed.chat import ChatEngine

    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go home."}],
            "tools": robot_tools[:2], "tool_choice": "required", "max_tokens": 24}
    first = ChatEngine(engine, context=1024).complete(ChatEngine(engine, context=1024).prepare(body))
    assert first.usage["prompt_tokens_details"]["cached_tokens"] == 0
    second = ChatEngine(engine, context=1024).complete(ChatEngine(engine, context=1024).prepare(body))
    cached = second.usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second.usage["prompt_tokens"] == first.usage["prompt_tokens"]
    assert second.timings["cached_tokens"] == cached
    assert second.timings["prefill_tokens"] == second.usage["prompt_tokens"] - cached
