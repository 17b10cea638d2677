"""Multi-process harness for the runtime tests: scenarios, data, workers, launcher, references.

One launch of ``world`` spawned processes runs a list of :class:`Scenario` s in sequence; each joins
its own process group (``file://`` rendezvous in the work dir, no ports) with the ranks it needs and
the others skip it. Rank 0 makes the global batch of each step (micro-batches of different shapes,
padded and packed rows), splits it over replicas and delivers; every rank saves its stage's
gradients and parameters under the original HF parameter names after each step. The parent process
computes the single-process references (:func:`reference_run`, :func:`singles_grads`) and compares.
Spawning costs ~5 s of imports per process on 2 cores, so tests share launches.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

VOCAB = 1024
NUM_MICRO_BATCHES = 6
LR, WEIGHT_DECAY = 1e-3, 0.01


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str  # "gpt2" | "t5" | "llama" | "qwen2" (the last two: tiny GQA configs of family_configs.py)
    preset: str
    num_stages: int
    num_replicas: int = 1
    policy: str = "1f1b"
    num_steps: int = 1
    max_grad_norm: float | None = None
    seed: int = 0
    timeout_s: float = 60.0
    dtype: str = "fp32"  # --dtype of the executor (bf16 / fp16: autocast over fp32 weights)
    placement: str = "linear"  # virtual stages: cyclic / interleaved:V chunks per device (num_stages = devices)
    placed_policy: str | None = None  # virtual stages: rank 0 passes the device orders of this policy as the planner does
    stages: tuple | None = None  # a hand-made layout (layer kinds per stage) instead of the balanced one

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas


def _s(family, stages, policy, replicas=1, steps=1, clip=None, seed=0):
    preset = {"gpt2": "gpt2-tiny" if stages <= 2 else "gpt2-mini", "t5": "t5-tiny" if stages <= 2 else "t5-mini"}[family]
    name = f"{family}-S{stages}xR{replicas}-{policy}-{steps}step"
    return Scenario(name, family, preset, stages, replicas, policy, steps, clip, seed)


SCENARIOS = {
    sc.name: sc
    for sc in [
        *(_s(f, s, p) for f in ("gpt2", "t5") for s in (2, 4) for p in ("gpipe", "1f1b", "adaptive")),
        _s("gpt2", 2, "1f1b", replicas=2, steps=3, clip=0.5, seed=1),
        _s("t5", 2, "adaptive", replicas=2, steps=3, clip=0.5, seed=2),
        _s("t5", 4, "1f1b", steps=3, clip=1.0, seed=3),
        # stage boundaries inside both blocks: a stage holds one block's MLP half and the next one's attention half
        Scenario("gpt2-S3xR1-halves-1step", "gpt2", "gpt2-tiny", 3, stages=(
            ("embedding", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head"))),
        # the same inside T5's encoder blocks: self-attention half | FFN half
        Scenario("t5-S3xR1-halves-1step", "t5", "t5-tiny", 3, stages=(
            ("embedding", "t5_enc_attn"), ("t5_enc_ffn", "t5_enc_attn"),
            ("t5_enc_ffn", "decoder_embedding", "t5_decoder", "t5_decoder", "lm_head"))),
    ]
}


# ----------------------------------------------------------------------------------------------
# Data and models (the same in workers and in the parent)
# ----------------------------------------------------------------------------------------------


def make_model(sc: Scenario):
    if sc.preset in DECODER_CONFIGS:
        from family_configs import build, decoder_config

        return build(decoder_config(vocab_size=VOCAB, **DECODER_CONFIGS[sc.preset]), seed=0)
    from dynabatch.models.presets import build_model

    return build_model(sc.preset, vocab_size=VOCAB, dropout=0.0, seed=0).train()


DECODER_CONFIGS = {
    "llama-gqa": dict(model_type="llama", num_heads=4, num_kv_heads=2, tie=False),  # untied head
    "qwen2-gqa": dict(model_type="qwen2", num_heads=4, num_kv_heads=1, tie=True),  # Q/K/V biases, tied head
}
"""Llama-style scenario models: 4 layers, d_model 64, grouped-query attention."""


def _sample(rng):
    from dynabatch.data.sample import TokenizedSample
    from dynabatch.models.presets import EOS_ID

    n_in, n_tgt = int(rng.integers(2, 12)), int(rng.integers(2, 8))
    inputs = np.append(rng.integers(3, VOCAB, n_in - 1), EOS_ID).astype(np.int32)
    targets = np.append(rng.integers(3, VOCAB, n_tgt - 1), EOS_ID).astype(np.int32)
    return TokenizedSample(task="t", input_ids=inputs, target_ids=targets)


def _collate(family, samples, rows, slack=0):
    from dynabatch.data.collate import collate_causal, collate_seq2seq
    from dynabatch.models.presets import PAD_ID

    if family != "t5":  # causal: gpt2, llama, qwen2
        row_len = max(sum(samples[i].num_tokens for i in r) for r in rows) + slack
        return collate_causal(samples, rows, pad_id=PAD_ID, row_len=row_len)
    enc = max(sum(samples[i].input_len for i in r) for r in rows) + slack
    dec = max(sum(samples[i].target_len for i in r) for r in rows) + slack
    return collate_seq2seq(samples, rows, pad_id=PAD_ID, decoder_start_id=PAD_ID, encoder_len=enc, decoder_len=dec)


def step_batch(family: str, seed: int, step: int, num_micro_batches: int = NUM_MICRO_BATCHES):
    """Samples and micro-batches of one global batch: rows of 1-3 samples (padding or packing),
    1-3 rows, sometimes extra padding; shapes differ between micro-batches."""
    rng = np.random.default_rng([seed, step])
    samples, mbs = [], []
    for _ in range(num_micro_batches):
        rows = []
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(1, 4))
            rows.append(list(range(len(samples), len(samples) + k)))
            samples += [_sample(rng) for _ in range(k)]
        mbs.append((rows, int(rng.integers(0, 3))))
    return samples, [_collate(family, samples, rows, slack) for rows, slack in mbs]


def split_replicas(mbs, num_replicas: int):
    return [mbs[p::num_replicas] for p in range(num_replicas)]


# Token-slice scenarios (TeraPipe): long samples cut into chains of slices, mixed with ordinary micro-batches.
SLICE_BOUNDS = (
    (0, 1, 2, 9, 30),  # uneven, two slices of length 1
    (0, 3, 6, 9, 12, 15, 18, 21, 24),  # many slices (8 + the rest), two rows: several samples per slice
    (0, 17),  # two slices
)


def sliced_units(seed: int, step: int):
    """Units of one sliced global batch: ``(micro_batch, bounds or None)``; a unit with bounds runs as
    a chain of token slices. Three ordinary micro-batches (padded and packed rows), a long sample cut
    unevenly with slices of length 1, two rows (one packed with two samples, one padded) cut into
    many slices, and a long sample cut in two."""
    from dynabatch.data.sample import TokenizedSample
    from dynabatch.models.presets import EOS_ID

    rng = np.random.default_rng([seed, step, 7])
    samples, mbs = step_batch("gpt2", seed, step, num_micro_batches=3)

    def long(n_in, n_tgt):
        inputs = np.append(rng.integers(3, VOCAB, n_in - 1), EOS_ID).astype(np.int32)
        targets = np.append(rng.integers(3, VOCAB, n_tgt - 1), EOS_ID).astype(np.int32)
        samples.append(TokenizedSample(task="t", input_ids=inputs, target_ids=targets))
        return len(samples) - 1

    a = long(25, 12)
    b1, b2, b3 = long(14, 6), long(6, 4), long(9, 9)
    c = long(20, 19)
    chains = [_collate("gpt2", samples, [[a]]), _collate("gpt2", samples, [[b1, b2], [b3]], slack=3),
              _collate("gpt2", samples, [[c]])]
    units = [(mbs[0], None)]
    for mb, bounds, plain in zip(chains, SLICE_BOUNDS, [mbs[1], mbs[2], None]):
        units.append((mb, bounds + (mb.shape[1],)))
        if plain is not None:
            units.append((plain, None))
    return units


def sliced_step(sc: "Scenario", step: int):
    """Per replica, the micro-batches (slices expanded) and their slice links."""
    from dynabatch.data.microbatch import token_slices
    from dynabatch.schedule.chains import links_for

    units = sliced_units(sc.seed, step)
    replica_mbs, replica_links = [], []
    for p in range(sc.num_replicas):
        mine = units[p::sc.num_replicas]
        pieces = [token_slices(mb, bounds) if bounds else [mb] for mb, bounds in mine]
        replica_mbs.append([x for ps in pieces for x in ps])
        replica_links.append(links_for([len(ps) for ps in pieces]))
    return replica_mbs, replica_links


def plain_step(sc: "Scenario", step: int):
    return split_replicas(step_batch(sc.family, sc.seed, step)[1], sc.num_replicas), None


def sliced_parents(sc: "Scenario", step: int):
    """The unsliced micro-batches of a sliced step (the reference runs them whole)."""
    return [mb for mb, _ in sliced_units(sc.seed, step)]


def _sl(stages, policy, replicas=1, steps=1):
    return Scenario(f"sliced-gpt2-S{stages}xR{replicas}-{policy}-{steps}step", "gpt2",
                    "gpt2-tiny" if stages <= 2 else "gpt2-mini", stages, replicas, policy, steps, seed=5)


SLICED_SCENARIOS = {
    sc.name: sc
    for sc in [_sl(2, "gpipe"), _sl(2, "1f1b"), _sl(2, "auto", steps=2), _sl(4, "1f1b"), _sl(4, "adaptive"),
               _sl(2, "1f1b", replicas=2),
               # virtual stages: 2 devices x 2 chunks, the slices' chains kept on every chunk; the placed order
               # train_step picks (auto), and DynaPipe's wait-free cyclic order handed over as the planner would
               Scenario("sliced-gpt2-interleaved2-R1-auto", "gpt2", "gpt2-mini", 2, 1, seed=5, placement="interleaved:2"),
               Scenario("sliced-gpt2-interleaved2-R2-wfc", "gpt2", "gpt2-mini", 2, 2, seed=5, placement="interleaved:2",
                        placed_policy="wait_free_cyclic")]
}
DROP_KV_GRAD = _sl(2, "1f1b")


def _ll(model_type, stages, policy, replicas=1, steps=1, sliced=False, clip=None):
    kind = "sliced-" if sliced else ""
    return Scenario(f"{kind}{model_type}-S{stages}xR{replicas}-{policy}-{steps}step", model_type, f"{model_type}-gqa",
                    stages, replicas, policy, steps, clip, seed=5 if sliced else 4)


LLAMA_SCENARIOS = {
    sc.name: sc
    for sc in [_ll("llama", 2, "gpipe"), _ll("llama", 4, "1f1b"), _ll("qwen2", 2, "adaptive"), _ll("qwen2", 4, "gpipe"),
               _ll("llama", 2, "1f1b", replicas=2, steps=3, clip=0.5), _ll("qwen2", 2, "adaptive", replicas=2, steps=3),
               _ll("llama", 2, "1f1b", sliced=True), _ll("qwen2", 4, "adaptive", sliced=True),
               _ll("llama", 4, "gpipe", sliced=True), _ll("qwen2", 2, "1f1b", replicas=2, steps=3, sliced=True)]
}
"""Llama and Qwen2 (GQA) pipelines: S = 2 and 4, gpipe / 1f1b / adaptive, 2 replicas x 2 stages over 3
AdamW steps, plain steps and steps mixing ordinary micro-batches with token-sliced chains."""


DTYPE_SCENARIOS = {
    sc.name: sc
    for sc in [
        Scenario("bf16-gpt2-S2xR1-1f1b-2step", "gpt2", "gpt2-tiny", 2, policy="1f1b", num_steps=2, dtype="bf16"),
        Scenario("bf16-t5-S2xR1-gpipe-2step", "t5", "t5-tiny", 2, policy="gpipe", num_steps=2, dtype="bf16"),
        Scenario("bf16-sliced-gpt2-S2xR1-1f1b-1step", "gpt2", "gpt2-tiny", 2, policy="1f1b", seed=5, dtype="bf16"),
        Scenario("fp16-gpt2-S2xR1-1f1b-2step", "gpt2", "gpt2-tiny", 2, policy="1f1b", num_steps=2, dtype="fp16"),
    ]
}
"""2-stage pipelines under bf16 / fp16 autocast on CPU (gloo): plain GPT-2 and T5 steps, a sliced GPT-2 step
(``sliced-`` in the name: :func:`sliced_step`) and fp16 with loss scaling."""


def dtype_worker(rank: int, names: list[str], workdir: str) -> None:
    _setup_worker()
    try:
        for name in names:
            sc = DTYPE_SCENARIOS[name]
            run_scenario(rank, sc, workdir, make_step=sliced_step if "sliced-" in name else plain_step)
    except BaseException as e:  # noqa: BLE001
        _report_failure(workdir, rank, e)


def make_optimizer(params, num_steps: int):
    # eps 1e-6: with the default 1e-8 a gradient of ~1e-8 (summation-order noise ~1e-10) moves a
    # parameter by a visibly different amount, which would test Adam, not the pipeline.
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / (num_steps + 1))
    return opt, sched


# ----------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------


def _setup_worker() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_scenario(rank: int, sc: Scenario, workdir: str, wrap_stage=None, make_step=plain_step, tag: str = "") -> None:
    """One scenario on this rank (a no-op for ranks outside its world). ``make_step(sc, step)`` gives
    rank 0 the replicas' micro-batches and slice links; results go to ``<name><tag>.rank<r>.pt``."""
    from dynabatch.cost.stages import StageLayout
    from dynabatch.models.split import build_device_stages, layout_for, pipeline_spec_for
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.precision import autocast_dtype
    from dynabatch.engine.step import train_step
    from dynabatch.engine.timeline import gather_timelines

    if rank >= sc.world_size:
        return
    ctx = init_distributed(
        sc.num_stages, sc.num_replicas, rank=rank, world_size=sc.world_size,
        init_method=f"file://{workdir}/{sc.name}{tag}.init", timeout_s=sc.timeout_s,
    )
    from dynabatch.schedule.placement import Placement

    model = make_model(sc)
    placement = Placement.parse(sc.placement, sc.num_stages)
    layout = StageLayout(sc.stages) if sc.stages else layout_for(model, placement.num_stages, placement)
    spec = pipeline_spec_for(model, layout, "float32")
    chunks = build_device_stages(model, layout, ctx.stage_index, sc.num_stages)
    del model
    stage = chunks[0]
    named = [(c.parameter_map[n], p) for c in chunks for n, p in c.named_parameters()]
    if wrap_stage is not None:  # one chunk per device: the wrapper (or the stage itself) runs it
        stage = chunks[0] = wrap_stage(stage, ctx)
    opt, sched = make_optimizer([p for c in chunks for p in c.parameters()], sc.num_steps)
    ex = Executor(chunks, ctx, opt, scheduler=sched, max_grad_norm=sc.max_grad_norm, autocast_dtype=autocast_dtype(sc.dtype))
    record = {"grads": [], "params": [], "loss": [], "grad_norm": [], "layout": layout.describe(), "timelines": [],
              "compute_dtypes": set(), "loss_scale": []}
    for module in (m for c in chunks for m in c.modules()):  # the dtypes the layers compute in (bf16 under autocast)
        module.register_forward_hook(lambda m, i, out: record["compute_dtypes"].add(str(out.dtype))
                                     if isinstance(out, torch.Tensor) and out.is_floating_point() else None)
    for step in range(sc.num_steps):
        replica_mbs = links = None
        schedules = None
        if ctx.is_planner:
            replica_mbs, links = make_step(sc, step)
            if sc.placed_policy is not None:
                schedules = [placed_schedule(mbs, placement, sc.placed_policy, links[p] if links else ())
                             for p, mbs in enumerate(replica_mbs)]
        result = train_step(ex, ctx, step, replica_mbs, spec=spec, policy=sc.policy, slice_links=links,
                            placement=placement, schedules=schedules)
        record["grads"].append({n: p.grad.detach().clone() for n, p in named})
        record["params"].append({n: p.detach().clone() for n, p in named})
        record["loss"].append(result.loss)
        record["grad_norm"].append(result.grad_norm)
        record["loss_scale"].append(result.loss_scale)
        timelines = gather_timelines(ctx, result)  # rank 0: {replica: [TimelineOp]}
        if timelines is not None:
            record["timelines"].append(timelines)
    torch.save(record, os.path.join(workdir, f"{sc.name}{tag}.rank{rank}.pt"))
    shutdown()


def placed_schedule(mbs, placement, policy: str, links=()):
    """The chunk schedule with device orders of ``policy`` for micro-batches ``mbs`` (token-slice ``links``) under
    token costs (what the trainer's planner hands train_step on virtual stages)."""
    from dynabatch.engine.step import micro_batch_shape
    from dynabatch.schedule.step import token_costs
    from dynabatch.schedule.virtual import chunk_schedule, placed_step

    result = placed_step(token_costs([micro_batch_shape(mb) for mb in mbs], placement.num_stages), placement,
                         policy=policy, links=links or ())
    return chunk_schedule(result.order, placement.num_stages, len(mbs), result.policy)


def _report_failure(workdir: str, rank: int, e: BaseException) -> None:
    with open(os.path.join(workdir, f"rank{rank}.err"), "w") as f:
        f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    sys.stderr.write(f"rank {rank} failed: {type(e).__name__}: {e}\n")
    sys.stderr.flush()
    os._exit(1)


def scenarios_worker(rank: int, names: list[str], workdir: str) -> None:
    _setup_worker()
    try:
        for name in names:
            run_scenario(rank, SCENARIOS[name], workdir)
    except BaseException as e:  # noqa: BLE001
        _report_failure(workdir, rank, e)


def sliced_worker(rank: int, names: list[str], workdir: str) -> None:
    """The token-slice scenarios, then :data:`DROP_KV_GRAD` again with the carried key/value gradient
    dropped (each slice's own keys/values get no gradient from the later slices; tag ``-dropped``)."""
    _setup_worker()
    try:
        for name in names:
            run_scenario(rank, SLICED_SCENARIOS[name], workdir, make_step=sliced_step)
        from dynabatch.models.slice_kv import SliceRecord

        SliceRecord.backward_roots = lambda self, carried: ([], [])
        run_scenario(rank, DROP_KV_GRAD, workdir, make_step=sliced_step, tag="-dropped")
    except BaseException as e:  # noqa: BLE001
        _report_failure(workdir, rank, e)


def llama_worker(rank: int, names: list[str], workdir: str) -> None:
    """The :data:`LLAMA_SCENARIOS`, sliced ones with :func:`sliced_step`."""
    _setup_worker()
    try:
        for name in names:
            sc = LLAMA_SCENARIOS[name]
            run_scenario(rank, sc, workdir, make_step=sliced_step if name.startswith("sliced-") else plain_step)
    except BaseException as e:  # noqa: BLE001
        _report_failure(workdir, rank, e)


class DyingStage(torch.nn.Module):
    """Wraps a stage; its ``calls``-th forward ends the process (``os._exit(17)``) or, with ``hang_s``,
    sleeps that long (a silent peer) and then exits with 18."""

    def __init__(self, inner, calls: int, hang_s: float | None = None, stamp_path: str | None = None) -> None:
        super().__init__()
        self.inner, self.calls, self.hang_s, self.stamp_path = inner, calls, hang_s, stamp_path
        self.stage_index, self.num_stages = inner.stage_index, inner.num_stages
        self.num_forwards = 0

    def tied_parameters(self):
        return self.inner.tied_parameters()

    def forward(self, received, loaded):
        self.num_forwards += 1
        if self.num_forwards == self.calls:
            if self.stamp_path:  # when it stopped, for the others' reaction time
                with open(self.stamp_path, "w") as f:
                    f.write(repr(time.time()))
            if self.hang_s is not None:
                time.sleep(self.hang_s)
                os._exit(18)
            os._exit(17)
        return self.inner(received, loaded)


def dead_rank_worker(rank: int, workdir: str, die_rank: int, timeout_s: float, hang_s: float | None = None) -> None:
    """2 x 2 GPT-2, two steps; rank ``die_rank`` dies (or hangs ``hang_s``) in its 2nd forward of step 1."""
    _setup_worker()
    sc = Scenario("dead-rank", "gpt2", "gpt2-tiny", 2, 2, "1f1b", num_steps=2, timeout_s=timeout_s)
    forwards_per_step = len(split_replicas(list(range(NUM_MICRO_BATCHES)), 2)[die_rank // 2])

    def wrap(stage, ctx):
        if ctx.rank != die_rank:
            return stage
        return DyingStage(stage, forwards_per_step + 2, hang_s, os.path.join(workdir, "stopped_at"))

    from dynabatch.engine.dist import exit_on_error

    sys.stderr = open(os.path.join(workdir, f"rank{rank}.err"), "w")  # exit_on_error reports here
    exit_on_error(run_scenario, rank, sc, workdir, wrap_stage=wrap)


def silent_gather_worker(rank: int, workdir: str, timeout_s: float) -> None:
    """2 ranks, no model: rank 1 stays silent (sleeps past the timeout) while rank 0 gathers to itself;
    rank 0 writes the error it got to ``gather.err``."""
    _setup_worker()
    from dynabatch.engine.dist import gather_to_planner, init_distributed

    ctx = init_distributed(1, rank=rank, world_size=2, init_method=f"file://{workdir}/rendezvous",
                           timeout_s=timeout_s, device="cpu")
    if rank == 1:
        time.sleep(timeout_s + 3)
        os._exit(0)
    try:
        gather_to_planner(ctx, {"F": {0: 1.0}}, "step 3's measured stage times")
        message = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        message = f"{type(e).__name__}: {e}"
    with open(os.path.join(workdir, "gather.err"), "w") as f:
        f.write(message)
    os._exit(0)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


PRELOAD = ["torch", "transformers", "dynabatch.models.split", "dynabatch.engine.step", "dynabatch.training.trainer",
           "pipeline_harness"]
"""What the fork server imports once. One server serves the whole test process: tests/dist/test_zero.py forks its
``dynabatch train`` ranks from it too (hence the trainer), whichever module starts it first."""


def launch(world_size: int, target, args: tuple, deadline_s: float) -> tuple[list[int | None], float]:
    """Start ``world_size`` processes ``target(rank, *args)``; join them within ``deadline_s``
    (stragglers are killed and reported as ``None``). Returns exit codes and elapsed seconds.

    ``forkserver`` with the heavy modules preloaded: the server imports torch and transformers once
    (about 8 s on 2 cores) and every worker is a fork of it, instead of importing them again.
    """
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(world_size)]
    start = time.monotonic()
    for p in procs:
        p.start()
    codes: list[int | None] = []
    for p in procs:
        p.join(max(0.0, deadline_s - (time.monotonic() - start)))
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes, time.monotonic() - start


def failures(workdir: str, world_size: int) -> str:
    out = []
    for r in range(world_size):
        path = os.path.join(workdir, f"rank{r}.err")
        if os.path.exists(path):
            out.append(f"--- rank {r}\n" + open(path).read())
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# References (parent process)
# ----------------------------------------------------------------------------------------------


def load_results(workdir: str, sc: Scenario, tag: str = "") -> dict:
    """Per step, the gradients and parameters by HF name, checked equal across tied copies and replicas."""
    records = [torch.load(os.path.join(workdir, f"{sc.name}{tag}.rank{r}.pt"), weights_only=False)  # our own files
               for r in range(sc.world_size)]
    out = {"grads": [], "params": [], "loss": records[-1]["loss"], "grad_norm": records[0]["grad_norm"],
           "layout": records[0]["layout"], "records": records}
    for step in range(sc.num_steps):
        for key in ("grads", "params"):
            merged: dict[str, torch.Tensor] = {}
            for r, rec in enumerate(records):
                for name, t in rec[key][step].items():
                    if name in merged:  # a tied copy or another replica: must be identical
                        torch.testing.assert_close(t, merged[name], rtol=0, atol=0, msg=f"{key} {name} rank {r}")
                    else:
                        merged[name] = t
            out[key].append(merged)
    return out


def reference_run(sc: Scenario, parents=None) -> dict:
    """The unsplit HF model over the same micro-batches, gradient accumulation of ``loss_sum / tokens``
    (``parents(sc, step)``: the step's micro-batches, unsliced; default the plain step's)."""
    from dynabatch.models.forward import forward_loss

    model = make_model(sc)
    opt, sched = make_optimizer(model.parameters(), sc.num_steps)
    out = {"grads": [], "params": [], "loss": [], "grad_norm": []}
    for step in range(sc.num_steps):
        mbs = parents(sc, step) if parents is not None else step_batch(sc.family, sc.seed, step)[1]
        total = sum(mb.num_loss_tokens for mb in mbs)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in mbs:
            res = forward_loss(model, mb)
            (res.loss_sum / total).backward()
            loss += float(res.loss_sum.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), sc.max_grad_norm or float("inf"))
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        sched.step()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        out["loss"].append(loss / total)
        out["grad_norm"].append(float(norm))
    return out


def singles_grads(sc: Scenario, step: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of step ``step`` with every sample run alone and unpadded (batch of one)."""
    from dynabatch.models.forward import forward_loss

    model = make_model(sc)
    samples, mbs = step_batch(sc.family, sc.seed, step)
    total = sum(mb.num_loss_tokens for mb in mbs)
    for i in range(len(samples)):
        mb = _collate(sc.family, samples, [[i]])
        (forward_loss(model, mb).loss_sum / total).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}
