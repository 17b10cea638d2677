"""Check once that every built-in task is learnable: train a tiny GPT-2 on CPU and compare losses.

Model: ``GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=8192))``, decoder-only
on ``inputs + targets + EOS`` with the loss on target tokens (and EOS) only. Samples longer than
``--max-len`` (512) keep the target (at most half the length) and the head and tail of the inputs.
Batches are length-bucketed and padded to a token budget; AdamW, lr 1e-3 with a short warm-up, a
uniform mix of all tasks. Prints the per-task mean target loss on held-out examples (seed 1) before
and after ``--seconds`` of training; exits 1 if any task's loss did not fall.

Run from the repository root (about 3-4 minutes on 2 cores)::

    .venv/bin/python scripts/check_learnable.py --seconds 150 --threads 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from dynabatch.data.builtin import BUILTIN_TASKS, DEFAULT_TOKENIZER_DIR, generate_examples

EOS_ID, PAD_ID = 1, 0


def encode(rows: list[dict], tokenizer, max_len: int) -> list[tuple[str, list[int], int]]:
    """``(task, ids, num_input_tokens)`` per row; the sequence is inputs + targets + EOS, truncated."""
    backend = tokenizer.backend_tokenizer
    inputs = backend.encode_batch([r["inputs"] for r in rows], add_special_tokens=False)
    targets = backend.encode_batch([r["targets"] for r in rows], add_special_tokens=False)
    out = []
    for row, inp, tgt in zip(rows, inputs, targets):
        tgt_ids = (tgt.ids + [EOS_ID])[: max_len // 2]
        budget = max_len - len(tgt_ids)
        inp_ids = inp.ids
        if len(inp_ids) > budget:  # keep the instruction (head) and the question (tail)
            head = budget // 4
            inp_ids = inp_ids[:head] + inp_ids[len(inp_ids) - (budget - head):]
        out.append((row["task"], inp_ids + tgt_ids, len(inp_ids)))
    return out


def make_batch(samples: list[tuple[str, list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and next-token ``labels`` (-100 off target)."""
    width = max(len(ids) for _, ids, _ in samples)
    input_ids = torch.full((len(samples), width), PAD_ID, dtype=torch.long)  # (B, T)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)  # label at t = token t+1
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (_, ids, num_inp) in enumerate(samples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        labels[i, num_inp - 1 : len(ids) - 1] = torch.tensor(ids[num_inp:])
    return input_ids, mask, labels


def target_losses(model: GPT2LMHeadModel, input_ids, mask, labels) -> torch.Tensor:
    """Per-sample mean cross-entropy over target positions; the LM head runs on those only."""
    hidden = model.transformer(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, T, D)
    sel = labels != -100
    logits = model.lm_head(hidden[sel])  # (N, V)
    per_token = torch.nn.functional.cross_entropy(logits, labels[sel], reduction="none")
    row = sel.nonzero()[:, 0]
    sums = torch.zeros(len(input_ids)).index_add_(0, row, per_token)
    return sums / sel.sum(1).clamp(min=1)


def bucketed_batches(samples, rng: np.random.Generator, token_budget: int):
    """Endless length-bucketed batches: pools of 512 samples sorted by length, cut by padded size."""
    while True:
        pool = [samples[i] for i in rng.choice(len(samples), size=512, replace=False)]
        pool.sort(key=lambda s: len(s[1]))
        batches, cur = [], []
        for s in pool:
            if cur and len(s[1]) * (len(cur) + 1) > token_budget:
                batches.append(cur)
                cur = []
            cur.append(s)
        batches.append(cur)
        for j in rng.permutation(len(batches)):
            yield batches[j]


@torch.no_grad()
def evaluate(model, eval_samples, batch_size: int = 16) -> dict[str, float]:
    model.eval()
    losses: dict[str, list[float]] = {}
    for k in range(0, len(eval_samples), batch_size):
        chunk = eval_samples[k : k + batch_size]
        for (task, _, _), loss in zip(chunk, target_losses(model, *make_batch(chunk)).tolist()):
            losses.setdefault(task, []).append(loss)
    model.train()
    return {t: float(np.mean(v)) for t, v in losses.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--train-per-task", type=int, default=1000)
    parser.add_argument("--eval-per-task", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER_DIR))
    train_rows = [r for t in BUILTIN_TASKS for r in generate_examples(t, args.train_per_task, 0)]
    eval_rows = [r for t in BUILTIN_TASKS for r in generate_examples(t, args.eval_per_task, 1)]
    train, held_out = encode(train_rows, tokenizer, args.max_len), encode(eval_rows, tokenizer, args.max_len)
    config = GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=len(tokenizer), n_positions=args.max_len,
                        bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    warmup = 30
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    start = evaluate(model, held_out)
    batches = bucketed_batches(train, np.random.default_rng(0), args.token_budget)
    t0, step, seen = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < args.seconds:
        batch = next(batches)
        loss = target_losses(model, *make_batch(batch)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        step, seen = step + 1, seen + len(batch)
        if step % 50 == 0:
            elapsed = time.perf_counter() - t0
            print(f"step {step:5d}  {elapsed:6.1f}s  samples {seen:6d}  loss {loss.item():.3f}", flush=True)
    end = evaluate(model, held_out)
    print(f"\ntrained {step} steps, {seen} samples in {time.perf_counter() - t0:.0f}s\n")
    print(f"{'task':18s} {'start':>7s} {'end':>7s}")
    for task in BUILTIN_TASKS:
        print(f"{task:18s} {start[task]:7.3f} {end[task]:7.3f}")
    failed = [t for t in BUILTIN_TASKS if not end[t] < start[t]]
    if failed:
        print(f"loss did not fall on: {', '.join(failed)}")
        raise SystemExit(1)
    print("loss fell on every task")


if __name__ == "__main__":
    main()
