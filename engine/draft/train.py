"""`tokenspeed draft train`: fit the co-located draft model to the target's own tool calls.

The draft (`tokenspeed.speculation.DraftModel`) is one or two Llama decoder layers between the
target's frozen token embeddings and the target's frozen lm_head rows for a reduced vocabulary.
Its layers start as slices of the target's first layers. Loss: cross-entropy against the
target's greedy token at every output position the draft will be asked about; grammar-forced
positions (never drafted by a model) weigh `aux_weight`. One sequence per step (the full
context - system prompt, tool schemas, observations - then the call), AdamW, cosine decay.

CPU-feasible: ~0.2-1 s per step on 2 cores for a 1-layer draft. Checkpoints (weights, optimizer,
step) let an interrupted run resume; the held-out report is teacher-forced top-1 agreement with
the target, i.e. the draft model's acceptance rate on the tokens it would propose.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from ..model import Transformer
from ..speculation import DraftModel
from .data import read_data

__all__ = ["draft_vocab", "train", "heldout_report", "context_view"]

# Differentiable forward: the model's forward is decorated with torch.no_grad() for inference.
_forward = Transformer.forward.__wrapped__


def draft_vocab(rows: list[dict], size: int, stop_ids: list[int]) -> torch.Tensor:
    """The draft's output vocabulary [<= size] int64: the most frequent tokens the target decides in
    `rows` (output tokens not forced by the grammar), then the most frequent prompt tokens of the
    observations (values are often copied from them), plus the stop tokens. Sorted ids."""
    decided = Counter(t for r in rows for t, f in zip(r["output_ids"], r["forced"]) if not f)
    prompts = Counter(t for r in rows for t in r["prompt_ids"][-256:])
    ids = list(dict.fromkeys([*stop_ids, *(t for t, _ in decided.most_common()),
                              *(t for t, _ in prompts.most_common())]))[:size]
    return torch.tensor(sorted(ids), dtype=torch.long)


def context_view(prompt_ids: list[int], window: int | None, rng: random.Random | None) -> list[int]:
    """The part of a prompt the draft sees at inference (`DraftState` with `window`): all of it up to
    1.5 window tokens, else its last window..1.5 window tokens (uniform with `rng`, else window)."""
    if not window or len(prompt_ids) <= window + window // 2:
        return prompt_ids
    keep = rng.randint(window, window + window // 2) if rng is not None else window
    return prompt_ids[-keep:]


def _example(row: dict, index: torch.Tensor, aux_weight: float, window: int | None = None,
             rng: random.Random | None = None):
    """(tokens [T], logit rows [K], targets [K] in draft-vocab indices, weights [K]) for one row:
    decided output tokens weigh 1, grammar-forced ones `aux_weight` (0 drops them). The prompt is
    cut to what the draft sees with `window` (`context_view`)."""
    prompt = context_view(row["prompt_ids"], window, rng)
    ids = prompt + row["output_ids"]
    p0 = len(prompt)
    rows, targets, weights = [], [], []
    for j, (t, forced) in enumerate(zip(row["output_ids"], row["forced"])):
        w = aux_weight if forced else 1.0
        if w > 0 and index[t] >= 0:
            rows.append(p0 + j - 1)
            targets.append(int(index[t]))
            weights.append(w)
    return (torch.tensor(ids), torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long),
            torch.tensor(weights))


def _logits(draft: DraftModel, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    cache = draft.net.new_cache(len(tokens))
    return _forward(draft.net, tokens, torch.arange(len(tokens)), cache, rows)


@torch.no_grad()
def heldout_report(draft: DraftModel, rows: list[dict], window: int | None = None) -> dict:
    """Teacher-forced top-1 agreement of the draft with the target on non-forced output tokens,
    the prompt cut to the last `window` tokens when longer than 1.5 window (`context_view`).

    Returns {"overall": {"tokens", "agree", "rate"}, family: {...}}; tokens outside the draft
    vocabulary count as disagreements.
    """
    out: dict[str, dict] = {}
    for r in rows:
        prompt = context_view(r["prompt_ids"], window, None)
        ids = prompt + r["output_ids"]
        p0 = len(prompt)
        pos = [p0 + j - 1 for j, f in enumerate(r["forced"]) if not f]
        if not pos:
            continue
        want = torch.tensor([t for t, f in zip(r["output_ids"], r["forced"]) if not f])
        logits = draft.net(torch.tensor(ids), torch.arange(len(ids)), draft.net.new_cache(len(ids)),
                           torch.tensor(pos))
        agree = int((draft.vocab[logits.argmax(-1)] == want).sum())
        for key in ("overall", r["family"]):
            s = out.setdefault(key, {"tokens": 0, "agree": 0})
            s["tokens"] += len(pos)
            s["agree"] += agree
    for s in out.values():
        s["rate"] = s["agree"] / s["tokens"] if s["tokens"] else None
    return out


def _index(draft: DraftModel) -> torch.Tensor:
    index = torch.full((draft.net.tok_embeddings.num_embeddings,), -1, dtype=torch.long)
    index[draft.vocab.cpu()] = torch.arange(len(draft.vocab))
    return index


def train(engine, data: Path, out_dir: Path, *, epochs: float = 2.0, lr: float = 1e-3, n_layers: int = 1,
          hidden_dim: int = 768, vocab_size: int = 4096, aux_weight: float = 0.0, checkpoint_every: int = 100,
          resume: bool = False, window: int | None = 1024,
          seed: int = 0, install: Path | None = None, progress: bool = True) -> dict:
    """Train a draft for `engine`'s target on the dataset's train split.

    Args:
        engine: a loaded `tokenspeed.Engine` (the target).
        data: dataset from `build_data`.
        out_dir: where `checkpoint.pt` (resumable) and `draft.safetensors` (final) go.
        epochs: passes over the train split (fractional allowed).
        lr: peak AdamW learning rate. n_layers, hidden_dim: draft architecture.
        vocab_size: draft output vocabulary size (tokens).
        aux_weight: loss weight of grammar-forced output tokens (never drafted by the model, but
            extra signal about where in the call it is); decided tokens weigh 1.
        checkpoint_every: steps between checkpoints.
        resume: continue from `out_dir/checkpoint.pt` if present.
        window: the draft attends over the context's last window..1.5 window tokens at inference
            (saved with the draft; `DraftState`), so longer prompts are cut to that in training;
            None: the whole context.
        install: also write the final draft there (e.g. the package's default draft path).
    Returns:
        report dict: steps, seconds, final train loss, held-out agreement, paths.
    Raises:
        ValueError: the dataset was built for another target, or has no train rows; epochs,
            vocab_size or window out of range; `resume` from a file that is not a checkpoint of
            this architecture.
    """
    from ..speculation import fingerprint

    if not epochs > 0 or vocab_size < 1 or (window is not None and window < 1):
        raise ValueError(f"train: need epochs > 0, vocab_size >= 1 and window >= 1 or None "
                         f"(got {epochs}, {vocab_size}, {window})")
    header, rows = read_data(data)
    if header["target"] != fingerprint(engine.model):
        raise ValueError(f"{data} was built for another target model ({header['model']})")
    train_rows = [r for r in rows if r["split"] == "train"]
    held_rows = [r for r in rows if r["split"] == "heldout"]
    if not train_rows:
        raise ValueError(f"{data} has no train rows")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint.pt"
    torch.manual_seed(seed)
    state = None
    if resume and ckpt_path.is_file():
        try:
            state = torch.load(ckpt_path, weights_only=False)
        except Exception as exc:  # torch raises pickle and zip errors of its own
            raise ValueError(f"{ckpt_path} is not a draft training checkpoint: {exc}") from exc
        if not isinstance(state, dict) or not {"vocab", "weights", "optimizer", "step"} <= set(state):
            raise ValueError(f"{ckpt_path} is not a draft training checkpoint")
    vocab = state["vocab"] if state else draft_vocab(train_rows, vocab_size, engine.tokenizer.stop_ids)
    draft = DraftModel.init_from_target(engine.model, vocab, n_layers=n_layers, hidden_dim=hidden_dim)
    params = [p for n, p in draft.net.named_parameters() if not n.startswith(("tok_embeddings.", "output."))]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = max(1, int(epochs * len(train_rows)))
    step = 0
    if state:
        try:
            draft.net.load_state_dict(state["weights"], strict=False)
            opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"{ckpt_path} was written for another draft architecture "
                             f"(--layers/--hidden): {str(exc).splitlines()[0]}") from exc
        step = state["step"]
    index = _index(draft)
    order = random.Random(seed)
    schedule = [i for _ in range(math.ceil(total / len(train_rows)) + 1)
                for i in order.sample(range(len(train_rows)), len(train_rows))][:total]
    draft.train()
    t0 = time.perf_counter()
    loss_ema = None
    bar = tqdm(total=total, initial=step, desc="draft train", unit="step", disable=not progress)
    while step < total:
        tokens, rows_k, targets, weights = _example(train_rows[schedule[step]], index, aux_weight, window, order)
        step += 1
        bar.update(1)
        if len(rows_k) == 0:
            continue
        for g in opt.param_groups:  # linear warm-up (20 steps), cosine decay to 10%
            g["lr"] = lr * min(1.0, step / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
        opt.zero_grad(set_to_none=True)
        # Each layer writes its keys/values into one shared cache tensor that earlier layers'
        # saved attention inputs view: let autograd copy those saved tensors on write.
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            ce = torch.nn.functional.cross_entropy(_logits(draft, tokens, rows_k), targets, reduction="none")
            loss = (ce * weights).sum() / weights.sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = loss.item()
        loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
        bar.set_postfix(loss=f"{loss_ema:.3f}")
        if step % checkpoint_every == 0 or step == total:
            torch.save({"weights": draft.trainable_state(), "optimizer": opt.state_dict(), "step": step,
                        "vocab": vocab}, ckpt_path)
    bar.close()
    draft.eval()
    report = {"steps": step, "train_rows": len(train_rows), "heldout_rows": len(held_rows),
              "seconds": round(time.perf_counter() - t0, 1), "train_loss_ema": loss_ema,
              "n_layers": n_layers, "hidden_dim": hidden_dim, "vocab": len(vocab), "aux_weight": aux_weight,
              "window": window, "heldout_agreement": heldout_report(draft, held_rows, window)}
    final = out_dir / "draft.safetensors"
    draft.window = window
    draft.save(final, extra=report)
    report["draft"] = str(final)
    if install is not None:
        draft.save(install, extra=report)
        report["installed"] = str(install)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return report
