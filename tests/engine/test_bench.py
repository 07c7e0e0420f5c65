"""AAL benchmark: deterministic workload, identical prompts across engines, call validation,
report maths, the quick end-to-end run (no speed assertions) and the GPU script on CPU."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenspeed
from tokenspeed.bench import main as bench_main
from tokenspeed.bench.aal import LLAMA_CPP_SERVER_DEPS, build_job, run_aal
from tokenspeed.bench.peers import check_call
from tokenspeed.bench.decode_profile import profile_decode
from tokenspeed.bench.kernel_gaps import NO_KERNELS, Kernel, device_kernels, kernel_gaps
from tokenspeed.bench.report import agreement, percentile, ratios, summarize, targets
from tokenspeed.bench.workload import Workload, bfcl_tool, build_workload


def test_workload_is_deterministic_and_round_trips(tmp_path):
    a, b = build_workload(seed=3), build_workload(seed=3)
    assert a.to_json() == b.to_json()
    assert build_workload(seed=4).to_json() != a.to_json()
    assert len(a.turns) == 10 and len(build_workload(seed=3, quick=True).turns) == 2
    names = [t["function"]["name"] for t in a.tools]
    assert {"pick", "place", "place_order"} <= set(names) and len(names) == len(set(names))
    assert Workload.load(a.save(tmp_path / "w.json")).to_json() == a.to_json()
    with pytest.raises(ValueError):
        build_workload(n_calls=-1)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an AAL workload"):
        Workload.load(tmp_path / "bad.json")


def test_bfcl_schemas_become_bounded_json_schema():
    tool = bfcl_tool({"name": "math.hypot", "description": "d", "parameters": {
        "type": "dict", "properties": {"x": {"type": "float"}, "n": {"type": "integer"}, "s": {"type": "string"}},
        "required": ["x", "missing"]}})
    p = tool["function"]["parameters"]
    assert p["type"] == "object" and p["required"] == ["x"] and p["additionalProperties"] is False
    assert p["properties"]["x"]["type"] == "number" and "maximum" in p["properties"]["x"]
    assert "maximum" in p["properties"]["n"] and p["properties"]["s"]["maxLength"] > 0
    tokenspeed.Engine.load("tiny-random").session(tools=[tool])  # compiles in TokenSpeed's grammar


def test_job_feeds_peers_the_ids_a_tokenspeed_session_holds():
    wl = build_workload(seed=0, quick=True)
    job = build_job(wl, threads=1, cold_turns=[1])
    engine = tokenspeed.Engine.load("tiny-random")  # same tokenizer as the real model
    session = engine.session(system=wl.system, tools=wl.tools)
    assert session.tokens == job["system_ids"]
    expected = list(job["system_ids"])
    for obs, ids in zip(wl.turns[0].observations, job["turns"][0]["obs_ids"]):
        session.observe(obs.content, role=obs.role, kind=obs.kind, source=obs.source)
        expected += ids
    assert session.tokens == expected
    assert job["turns"][1]["schema"]["properties"]["name"] == {"const": wl.turns[1].expect}  # named choice
    assert "oneOf" in job["turns"][0]["schema"]


def test_check_call_validates_against_the_tool_schema():
    tools = build_workload(seed=0, quick=True).tools
    ok = '<tool_call>[{"name": "pick", "arguments": {"object": "red_cube"}}]</tool_call>'
    assert check_call(ok, tools) == ({"name": "pick", "arguments": {"object": "red_cube"}}, True)
    assert check_call(ok, tools, expect_name="place")[1] is False
    assert check_call(ok.replace("red_cube", "pink_cube"), tools)[1] is False
    assert check_call('<tool_call>[{"name": "pick"', tools) == (None, False)


def _run(engine, ttfts, itl, turn_ms, calls):
    return {"engine": engine, "config": "", "threads": 2, "weight_bytes": 140e6, "peak_rss_mb": 100.0,
            "short_itl_ms": itl, "cold_ttft_ms": [{"turn": 0, "context_tokens": 4000, "ttft_ms": 30000.0}],
            "turns": [{"ttft_ms": t, "itl_ms": itl, "decide_ms": 100.0, "turn_ms": turn_ms, "output_tokens": 10,
                       "forwards": 5, "forced_tokens": 4, "valid": True, "context_tokens": 1000, "tool_call": c}
                      for t, c in zip(ttfts, calls)]}


def test_report_percentiles_ratios_targets_and_agreement():
    assert percentile([5, 1, 4, 2, 3], 50) == 3 and percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9
    assert percentile([], 50) is None
    runs = {"tokenspeed-int4": _run("tokenspeed-int4", [50, 60, 70], [10.0], 300, [{"a": 1}, {"b": 2}, {"c": 3}]),
            "tokenspeed-fp32": _run("tokenspeed-fp32", [50, 60, 70], [20.0], 600, [{"a": 1}, {"b": 2}, {"x": 0}]),
            "llama.cpp": _run("llama.cpp", [1000, 1200, 1500], [15.0], 3000, [{}, {}, {}]),
            "tokenspeed-int4-http": _run("tokenspeed-int4-http", [80, 90, 100], [10.0], 400, [{}, {}, {}]),
            "llama.cpp-http": _run("llama.cpp-http", [900, 1000, 1100], [15.0], 2000, [{}, {}, {}])}
    s = {k: summarize(r, bandwidth_gbs=14.0) for k, r in runs.items()}
    assert s["tokenspeed-int4"]["ttft_p50_ms"] == 60 and s["tokenspeed-int4"]["floor_ms"] == pytest.approx(10.0)
    assert s["llama.cpp"]["turn_ms"] == 9000 and s["tokenspeed-int4"]["jump_forward_tokens"] == 12
    met = {t["target"]: t["met"] for t in targets(s)}
    assert all(met.values()), targets(s)
    # an HTTP peer is compared with our HTTP row, a direct peer with our direct row
    r = ratios(s)
    assert r["llama.cpp-http"]["ours"] == "tokenspeed-int4-http" and r["llama.cpp-http"]["turn_ms"] == pytest.approx(0.2)
    assert r["llama.cpp"]["ours"] == "tokenspeed-int4" and r["llama.cpp"]["turn_ms"] == pytest.approx(0.1)
    a = agreement(runs)
    assert a["same_calls"] == 2 and a["calls"] == 3


@pytest.mark.timeout(1500)
def test_quick_aal_runs_every_engine_and_writes_the_report(tmp_path, capsys):
    assert bench_main(["aal", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    engines = set(report["summary"])
    # the HTTP rows: `tokenspeed serve` always; llama_cpp.server where llama-cpp-python and its server extra are
    expected = {"tokenspeed-int4", "tokenspeed-int4-plain", "tokenspeed-fp32", "transformers", "tokenspeed-int4-http"}
    llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if llama_cpp:
        expected.add("llama.cpp")
    if llama_cpp and all(importlib.util.find_spec(m) for m in LLAMA_CPP_SERVER_DEPS):
        expected.add("llama.cpp-http")
    else:
        assert any(n.startswith("llama.cpp-http row skipped: ") for n in report["notes"]), report["notes"]
    assert engines == expected
    for s in report["summary"].values():
        assert s["calls"] == 2 and s["ttft_p50_ms"] > 0 and s["peak_rss_mb"] > 0 and s["floor_ms"] > 0
    # TokenSpeed's grammar guarantees schema-valid calls, over HTTP too; jump-forward skips forwards.
    assert report["summary"]["tokenspeed-int4"]["valid_calls"] == 2
    assert report["summary"]["tokenspeed-int4-http"]["expected_tool_calls"] == 2
    assert report["summary"]["tokenspeed-int4"]["jump_forward_tokens"] > 0
    assert report["agreement"]["calls"] == 2
    assert (tmp_path / "aal.png").stat().st_size > 10_000
    # Speculation is lossless (same calls as without it) and reported per source.
    ours, plain = report["summary"]["tokenspeed-int4"], report["summary"]["tokenspeed-int4-plain"]
    assert ours["decided_tokens"] == plain["decided_tokens"] > 0 and plain["spec_sources"] == {}
    assert plain["decided_per_forward"] == 1.0 and ours["decided_per_forward"] >= 1.0
    assert ours["itl_short_p50_ms"] > 0 and report["summary"]["tokenspeed-fp32"]["itl_short_p50_ms"] > 0
    out = capsys.readouterr().out
    assert "ratios ours / peer" in out and "speculation (tokenspeed-int4)" in out
    assert "HTTP 10-call turn <= 0.5x llama.cpp HTTP" in out


def test_aal_refuses_a_llama_cpp_folder_without_llama_cpp(tmp_path, monkeypatch):
    # $TOKENSPEED_LLAMA_CPP points the llama.cpp peer at another build (make peers-avx2); a wrong
    # folder is refused before anything runs, even in a quick run that skips a missing llama.cpp.
    monkeypatch.setenv("TOKENSPEED_LLAMA_CPP", str(tmp_path))
    with pytest.raises(ValueError, match="holds no llama_cpp package"):
        run_aal(tmp_path / "out", quick=True, engines=["tokenspeed", "llama.cpp"])
    assert not (tmp_path / "out").exists()


def test_gpu_device_check_runs_end_to_end_on_cpu(tmp_path, capsys):
    """`tokenspeed bench gpu` with small shapes on CPU: every section runs (Triton kernels under the
    interpreter), parity of the same fp32 weights is exact, and gpu.json holds each section."""
    assert bench_main(["gpu", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    sec = res["sections"]
    assert res["failed"] == [] and res["bandwidth_gbs"] > 0
    assert sec["kernels"]["ok"] and sec["kernels"]["attention"] and sec["kernels"]["norm"]
    for key in ("decode_big", "decode_embedded"):
        rows = sec[key]["rows"]
        assert [(r["weights"], r["cache"], r["step"]) for r in rows] == [
            ("float32", "full", "eager"), ("float32", "full", "graph"), ("float32", "full", "eager"),
            ("float32", "full", "graph"), ("float32", "pruned 40", "eager"),
            ("int8", "full", "graph"), ("int8", "full", "graph"), ("int4", "full", "graph"), ("int4", "full", "graph")]
        assert rows[7]["floor_ms"] < rows[5]["floor_ms"] < rows[0]["floor_ms"]   # each format's own weight bytes
        assert rows[4]["attended"] <= 40 + 16 < rows[2]["attended"]    # the pruned cache reads its hot tier only
        assert rows[2]["attended"] == rows[3]["attended"]              # the graph runner's step reads the same slots
        for r in rows:
            assert r["ttft_ms"] > 0 and r["itl_p50_ms"] > 0 and r["floor_ctx_ms"] >= r["floor_ms"] > 0
    assert sec["decode_big"]["rows"][0]["model"].startswith("tiny-shape")
    par = sec["parity"]
    assert par["ok"] and par["identical_tokens"] == par["tokens"] == 8 and par["max_rel_logit_err"] < 1e-5
    for key in ("agent_embedded", "agent_embedded_serial", "agent_big"):
        a = sec[key]
        assert a["calls"] == 2 and a["turn_ms"] > 0 and a["warm_ttft_p50_ms"] > 0 and a["warm_context_tokens"] >= 256
    assert sec["agent_embedded_serial"]["pipeline"] is False and sec["agent_embedded_serial"]["drafted_ahead"] == 0
    # the profile section runs its CPU-only profiler: one warm decision per engine, no device kernels
    prof = sec["profile"]["rows"]
    assert [r["model"] for r in prof] == ["tiny-random", "tiny-shape body (random)"]
    for r in prof:
        assert r["kernels"] == 0 and r["note"] == NO_KERNELS and r["largest"] == [] and r["idle_fraction"] is None
        assert r["forwards"] > 0 and r["decide_ms"] >= r["ttft_ms"] > 0 and r["unprofiled_decide_ms"] > 0
    out = capsys.readouterr().out
    assert "10-call AAL turn" in out and "112" in out and "parity vs CPU fp32: 8/8" in out
    assert "pipelined drafting off -> off" in out  # the CPU's default: no pipelining
    assert "device idle between the kernels" in out and NO_KERNELS in out


def test_kernel_gaps_counts_overlap_once_and_names_the_kernels_around_each_gap():
    ks = [Kernel("gemm", 0.0, 10.0), Kernel("copy", 5.0, 10.0),  # two streams: busy 0..15 once
          Kernel("norm", 20.0, 2.0), Kernel("attn", 22.0, 3.0), Kernel("argmax", 125.0, 5.0)]
    g = kernel_gaps(reversed(ks), largest=2)  # any order
    assert g["kernels"] == 5 and g["busy_us"] == 15 + 2 + 3 + 5 and g["span_us"] == 130
    assert g["idle_us"] == 5 + 100 and g["idle_fraction"] == pytest.approx(105 / 130)
    # gaps before copy, norm, attn, argmax: 0 (overlap), 5, 0 (back to back), 100
    assert (g["gap_p50_us"], g["gap_p90_us"], g["gap_max_us"]) == (0.0, 100.0, 100.0)
    assert g["largest"] == [{"gap_us": 100.0, "at_us": 25.0, "before": "attn", "after": "argmax"},
                            {"gap_us": 5.0, "at_us": 15.0, "before": "copy", "after": "norm"}]
    one = kernel_gaps([Kernel("gemm", 3.0, 4.0)])
    assert one["busy_us"] == one["span_us"] == 4 and one["idle_fraction"] == 0 and one["gap_p50_us"] is None
    none = kernel_gaps([])
    assert none["kernels"] == 0 and none["note"] == NO_KERNELS and none["busy_us"] is None and none["largest"] == []
    with pytest.raises(ValueError, match="negative duration"):
        kernel_gaps([Kernel("gemm", 0.0, -1.0)])


def test_device_kernels_takes_the_cuda_activities_of_a_profile_but_not_its_annotations():
    """Built FunctionEvents in the shape of a CUDA profile's (no CUDA device on the test machines:
    a real CPU-only profile, which has none of them, runs in the device check test above)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(name, start, end, device, annotation=False):
        return FunctionEvent(0, name, 1, start, end, device_type=device, is_user_annotation=annotation)

    events = [event("tokenspeed.decide", 0.0, 90.0, DeviceType.CPU, True), event("aten::mm", 1.0, 9.0, DeviceType.CPU),
              event("tokenspeed.decide", 12.0, 80.0, DeviceType.CUDA, True),  # the GPU range of the annotation
              event("sm90_gemm", 12.0, 40.0, DeviceType.CUDA), event("Memcpy HtoD", 55.0, 56.5, DeviceType.CUDA)]
    assert device_kernels(events) == [Kernel("sm90_gemm", 12.0, 28.0), Kernel("Memcpy HtoD", 55.0, 1.5)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), min_size=1, max_size=12))
def test_kernel_gaps_busy_time_is_the_union_of_the_intervals(intervals):
    g = kernel_gaps(Kernel(f"k{i}", s, d) for i, (s, d) in enumerate(intervals))
    cells = {t for s, d in intervals for t in range(s, s + d)}  # unit cells covered by some kernel
    assert g["busy_us"] == len(cells)
    assert g["span_us"] == max(s + d for s, d in intervals) - min(s for s, _ in intervals)
    assert g["idle_us"] == g["span_us"] - g["busy_us"] >= 0
    assert g["gap_max_us"] == (g["largest"][0]["gap_us"] if g["largest"] else None)


def test_profile_reports_ops_and_matmul_share():
    res = profile_decode("tiny-random", quantize=None, steps=2, context=16, rows=5)  # fp32: ATen GEMMs
    assert res["fused"] and res["wall_ms_per_token"] > 0 and res["ops_per_token"] > 0
    assert 0 < res["matmul_share"] <= 1 and len(res["top"]) == 5


def test_bench_kv_help_lists_its_subcommands(capsys):
    for argv in (["kv", "--help"], ["kv", "cost", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            bench_main(argv)
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "needle" in out and "agreement" in out and "--budget" in out


def test_bench_auto_reports_call_rates_before_and_after_and_runaways():
    from tokenspeed.bench.auto import run_auto

    # shapes only: random weights
    report = run_auto(0.5, required=True, model="tiny-random", quantize=None, limit=2)
    assert report["cases"] == {"call": 2, "text": 2} and report["runaway"]["cases"] == 4
    for key in ("before", "after"):
        assert 0 <= report[key]["call_when_applies"] <= 1 and 0 <= report[key]["call_when_none"] <= 1
    assert all(r["after"] == (r["p_call"] >= 0.5) for r in report["rows"])  # the rule, through decide()
    # calibration holds in the 1st, 3rd, ... case of each source and label and reports the others apart
    assert [r["held_out"] for r in report["rows"]] == [False, True, False, True]
    assert set(report["held_in"]) == set(report["held_out"]) == {"call_when_applies", "call_when_none"}
    with pytest.raises(ValueError, match="no auto threshold"):
        run_auto(None, model="tiny-random", limit=1)


def test_quick_prefill_bench_reports_every_cell_against_llama_cpp(tmp_path, capsys):
    # the plumbing of `tokenspeed bench prefill` (timings are not asserted): TokenSpeed with the
    # full and with a pruned KV cache, llama.cpp where installed, floors, ratios and growth per cell
    from tokenspeed.kernels.cpu_decode import native_variant

    assert bench_main(["prefill", "--quick", "--threads", "1", "--variants", native_variant(), "--kv-budget", "96",
                       "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    names = [(r["engine"], r.get("kv_budget")) for r in report["rows"]]
    assert names == [("tokenspeed", None), ("tokenspeed", 96)] + [("llama.cpp", None)] * llama_cpp
    for r in report["rows"]:
        assert [(c["prefix"], c["new"]) for c in r["cells"]] == [(0, 8), (0, 24), (40, 8), (40, 24)]
        assert all(c["ms_per_token"] > 0 and c["floor_ms_per_token"] > 0 for c in r["cells"])
        assert set(r["growth"]) == {"8", "24"}  # per N (JSON keys)
        if r["engine"] == "tokenspeed":
            assert r["cpu_kernels"] == native_variant() and r["fused"]
            assert all((c["vs_llama_cpp"] is not None) == llama_cpp for c in r["cells"])
    assert not llama_cpp or not report["notes"]
    out = capsys.readouterr().out
    assert "prefill ms/token" in out and "goal <= 0.5x llama.cpp everywhere" in out


def test_serve_bench_probes_health_and_a_sleeper_during_each_burst(tmp_path, capsys):
    """`bench serve` against a real `tokenspeed serve` process: every request is answered (200, or 429
    beyond the queue of 8), /health and the sleeping process are sampled in the burst (no timing asserted)."""
    assert bench_main(["serve", "--bursts", "1", "--requests", "12", "--max-tokens", "32", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    (burst,) = report["bursts"]
    assert set(burst["statuses"]) <= {"200", "429"} and sum(burst["statuses"].values()) == 12
    assert burst["statuses"].get("429", 0) <= 12 - 9  # at most the running one and 8 waiting are admitted
    assert burst["health"]["n"] >= 1 and burst["sleep"]["n"] >= 1 and report["health"] == burst["health"]
    assert "goal: slowest /health < 50 ms" in capsys.readouterr().out


def test_agreement_bench_compares_logits_with_llama_cpp_on_a_file_its_quantizer_made(tmp_path, monkeypatch, capsys):
    # `tokenspeed bench agreement` on a short run: the embedded model re-quantized to Q8_0 by llama.cpp
    # (cached: a second run reuses the file), teacher-forced workload positions through both engines
    pytest.importorskip("llama_cpp")
    from tokenspeed.bench import agreement as ag

    monkeypatch.setattr(ag, "cache_dir", lambda: tmp_path / "cache")
    assert bench_main(["agreement", "--formats", "Q8_0", "--positions", "48", "--threads", "1",
                       "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    r = report["files"]["Q8_0"]
    assert r["positions"] == 48 and r["types"]["Q8_0"] > 0 and set(r["types"]) <= {"Q8_0", "F32"}
    # the goal (99%, 0.01) is the bench's, over 2,000 positions; of these 48 each is 2% of top-1, and llama.cpp
    # against itself (f16 KV cache) loses two: near-ties flip with the kernels' float rounding
    assert r["top1"] >= 0.9 and 0 <= r["kl_mean"] <= 0.02
    assert 0.5 <= r["floor"]["top1"] <= 1 and 0 <= r["floor"]["kl_mean"] <= 0.02  # llama.cpp f32 vs f16 KV cache
    made = Path(r["file"])
    assert made.parent == tmp_path / "cache" / "agreement"
    stamp = made.stat().st_mtime_ns
    assert ag.quantized_file("Q8_0") == made and made.stat().st_mtime_ns == stamp
    assert "Q8_0" in capsys.readouterr().out
    same = ag.compare(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[0.0, 1.0, 2.0]]))
    assert same == {"positions": 1, "top1": 1.0, "kl_mean": 0.0, "kl_max": 0.0}
    with pytest.raises(ValueError, match="no Q3_X quantization"):
        ag.quantized_file("Q3_X")


def test_scale_shapes_have_the_published_parameter_counts():
    # the random models are the real shapes: their weight counts are the checkpoints' (tied heads once)
    from tokenspeed.bench.scale import SHAPES

    assert {k: SHAPES[k].params() for k in ("135m", "0.5b", "1.5b", "3b")} == {
        "135m": 134_515_008, "0.5b": 494_032_768, "1.5b": 1_543_714_304, "3b": 3_212_749_824}


def test_scale_bench_runs_the_whole_pipeline_on_a_tiny_shape(tmp_path, monkeypatch, capsys):
    # `tokenspeed bench scale` on the tiny shape: a random F16 GGUF written with the gguf writer,
    # quantized by llama.cpp (cached), both engines in their own processes on the same file, one row
    pytest.importorskip("llama_cpp")
    pytest.importorskip("matplotlib")
    import gguf

    from tokenspeed.bench import scale

    monkeypatch.setattr(scale, "_folder", lambda: tmp_path / "cache")
    assert bench_main(["scale", "--sizes", "tiny", "--formats", "Q4_K_M", "--threads", "1", "--quick",
                       "--repeats", "1", "--steps", "3", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (row,) = report["rows"]
    assert (row["size"], row["format"], row["threads"], row["params"]) == ("tiny", "Q4_K_M", 1, 13_764_864)
    assert "Q4_K" in row["types"] and "F16" not in row["types"]
    ours, theirs = row["engines"]["tokenspeed"], row["engines"]["llama.cpp"]
    assert ours["weights"] == "gguf" and ours["fused"] and 0 < ours["weight_bytes"]
    for rec in (ours, theirs):
        assert [c["new"] for c in rec["prefill"]] == list(scale.QUICK_NEW)
        assert [c["context"] for c in rec["itl"]] == list(scale.QUICK_CONTEXTS)
        assert all(c["ms_per_token"] > 0 for c in rec["prefill"]) and all(c["ms"] > 0 for c in rec["itl"])
        assert rec["load_s"] > 0 and 0 < rec["base_rss_mb"] < rec["peak_rss_mb"]
    # each engine's own peak RSS, not its parent's: the llama.cpp process imports no torch
    assert theirs["peak_rss_mb"] < ours["peak_rss_mb"] and theirs["peak_rss_mb"] < 300
    assert ours["cold_load"]["load_s"] > 0
    mem = ours["cold_load"]["load_rss_mb"]  # the peak during Engine.load, after Python and torch
    assert 0 < mem["before"] < mem["peak"] <= ours["cold_load"]["peak_rss_mb"] and "tokenizer" in mem["stages"]
    assert set(row["ratios"]) >= {"itl_32", "itl_96", "prefill_8", "prefill_24", "rss", "load", "engine_rss"}
    # the processes' bases: torch's imports against llama_cpp's
    assert theirs["base_rss_mb"] < ours["base_rss_mb"] and row["ratios"]["engine_rss"] > 0
    assert row["floor_ms"]["llama.cpp"] > 0 and row["floor_ms"]["tokenspeed"] > 0
    assert (tmp_path / "out" / "scale.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "tiny" in out and "Q4_K_M" in out and "peak RSS during Engine.load" in out
    # --merge joins runs (one size each) into one table and plot, measuring nothing
    report_path = str(tmp_path / "out" / "report.json")
    assert bench_main(["scale", "--merge", report_path, report_path, "--out", str(tmp_path / "merged")]) == 0
    assert len(json.loads((tmp_path / "merged" / "report.json").read_text())["rows"]) == 2
    assert (tmp_path / "merged" / "scale.png").is_file()
    source = scale.source_file("tiny")  # cached: the same file, not written again
    reader = gguf.GGUFReader(str(source))
    assert {t.tensor_type.name for t in reader.tensors} == {"F16", "F32"} and len(reader.tensors) == 26
    stamp = source.stat().st_mtime_ns
    assert scale.model_file("tiny", "Q4_K_M", threads=1) == Path(row["file"]) and source.stat().st_mtime_ns == stamp
