"""The draft recipe end to end on a tiny configuration: build-data with the real target (a few
robot, trading and BFCL tasks and one short agent session), train a small draft with a checkpoint
and a resume, evaluate it on the held-out split, and load it into a speculating session."""
import json

import pytest
import torch

from tokenspeed.draft import main
from tokenspeed.draft.data import read_data
from tokenspeed.speculation import DraftModel, SpecConfig


@pytest.mark.slow
def test_recipe_end_to_end(tmp_path, engine, capsys):
    data = tmp_path / "data.jsonl"
    tiny = ["--robot", "2", "--trading", "2", "--bfcl-limit", "2", "--agent", "1", "--agent-calls", "2"]
    assert main(["build-data", "--out", str(data), *tiny]) == 0
    header, rows = read_data(data)
    assert {r["split"] for r in rows} == {"train", "heldout"}  # index 0 of each family is held out
    assert {r["family"] for r in rows} == {"robot", "trading", "bfcl", "agent"}
    agent = [r for r in rows if r["family"] == "agent"]  # one session: the second call sees the first
    assert [r["id"] for r in agent] == ["agent_1_0", "agent_1_1"]
    assert agent[1]["prompt_ids"][:len(agent[0]["prompt_ids"])] == agent[0]["prompt_ids"]
    for r in rows:
        assert len(r["forced"]) == len(r["output_ids"]) and 0 < sum(r["forced"]) < len(r["forced"])
        assert engine.tokenizer.decode(r["output_ids"]) == r["text"]
    capsys.readouterr()
    # --resume answers only the tasks not in the file yet: here none.
    assert main(["build-data", "--out", str(data), *tiny, "--resume"]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["kept"] == len(rows) and sum(resumed["written"].values()) == 0
    assert read_data(data)[1] == rows

    out = tmp_path / "run"
    small = ["--data", str(data), "--out", str(out), "--hidden", "64", "--vocab", "512", "--checkpoint-every", "1",
             "--window", "256"]  # agent prompts are longer: trained on their last 256-384 tokens
    assert main(["train", *small, "--epochs", "1"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["train", *small, "--epochs", "2", "--resume"]) == 0  # continues from the checkpoint
    second = json.loads(capsys.readouterr().out)
    assert second["steps"] == 2 * first["steps"] == 2 * first["train_rows"]
    assert second["heldout_agreement"]["overall"]["tokens"] > 0

    assert main(["eval", "--data", str(data), "--draft", str(out / "draft.safetensors"), "--repeats", "1",
                 "--k", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    settings = report["settings"]
    assert report["rows"] == 3  # held out: robot_0, trading_0, the first BFCL case (agent rows: speedup)
    assert set(settings) == {"plain", "lookup", "model", "lookup+model", "adaptive"}
    for name, s in settings.items():
        assert s["identical"] == "3/3", name  # lossless: every setting reproduces plain greedy
    assert settings["model"]["proposed"] > 0 and settings["plain"]["proposed"] == 0

    assert main(["eval", "--data", str(data), "--draft", str(out / "draft.safetensors"), "--analyze"]) == 0
    analysis = json.loads(capsys.readouterr().out)
    total = analysis["by_class"]["all"]
    assert analysis["tokens"] == total["tokens"] == sum(
        analysis["by_class"][c]["tokens"] for c in ("number", "word", "punct")) > 0
    assert total["model"] <= total["model_top2"] <= total["tokens"]

    assert main(["speedup", "--quick", "--repeats", "1", "--draft", str(out / "draft.safetensors")]) == 0
    speed = json.loads(capsys.readouterr().out)
    assert speed["turns"] == 2 and speed["settings"]["spec"]["identical"] == "2/2"

    draft = DraftModel.load(out / "draft.safetensors", engine.model)
    saved = engine.speculation
    engine.speculation = SpecConfig(draft=draft)
    try:
        assert engine.session().generate("Say yes.", max_tokens=4)
    finally:
        engine.speculation = saved


def test_draft_errors_are_clear(tmp_path, engine, capsys):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["train", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        DraftModel.load(bad, engine.model)
    with pytest.raises(FileNotFoundError):
        DraftModel.load(tmp_path / "none.safetensors", engine.model)


def test_bad_files_and_settings_are_refused_with_their_names(tmp_path, engine):
    """Files that parse but are not what they claim, and out-of-range settings, end in one-line
    errors naming the file or the setting (no tracebacks): the fresh-user check's repros."""
    import dataclasses

    from safetensors.torch import save_file

    from tokenspeed.speculation import DEFAULT_DRAFT

    arr = tmp_path / "arr.jsonl"
    arr.write_text("[1, 2, 3]\n")
    with pytest.raises(SystemExit, match="arr.jsonl is not a"):
        main(["train", "--data", str(arr), "--out", str(tmp_path / "t")])
    draft = DraftModel.load(DEFAULT_DRAFT, engine.model)
    state = {k: v.to(torch.float16) for k, v in draft.trainable_state().items()}
    meta = {"tokenspeed_draft": json.dumps({**draft.meta, "extra": {}})}
    for name, change in (("shape", lambda s: s.update({k: v[:-1] for k, v in s.items() if v.dim() == 2})),
                         ("vocab", lambda s: s.update({"draft.vocab": torch.tensor([10**6], dtype=torch.int32)}))):
        tensors = dict(state, **{"draft.vocab": draft.vocab.to(torch.int32)})
        change(tensors)
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(ValueError, match=str(path)):
            DraftModel.load(path, engine.model)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "checkpoint.pt").write_bytes(b"garbage")
    data = tmp_path / "data.jsonl"
    row = {"id": "r", "family": "robot", "split": "train", "prompt_ids": [1, 2, 3], "output_ids": [4, 5],
           "forced": [0, 0]}
    data.write_text("\n".join(json.dumps(x) for x in (
        {"format": "tokenspeed-draft-data/1", "target": draft.target_id, "model": "x"}, row)) + "\n")
    with pytest.raises(SystemExit, match="checkpoint.pt is not a draft training checkpoint"):
        main(["train", "--data", str(data), "--out", str(tmp_path / "ck"), "--resume"])
    for argv in (["--window", "-5"], ["--epochs", "0"], ["--vocab", "0"]):
        with pytest.raises(SystemExit, match="train: need"):
            main(["train", "--data", str(data), "--out", str(tmp_path / "t2"), *argv])
    with pytest.raises(ValueError, match="max_k"):
        SpecConfig(max_k=0)
    with pytest.raises(TypeError, match="SpecConfig or None"):
        engine.speculation = True
    assert dataclasses.replace(engine.speculation, forced_text=False).draft is engine.speculation.draft
