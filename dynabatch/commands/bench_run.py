"""``dynabatch bench``, the measurement: every method's executor built, its steps planned, the steps run interleaved
and timed (what is measured and how: :mod:`dynabatch.commands.bench`, which holds the flags and imports this module
only when a benchmark runs, so ``dynabatch bench --help`` loads no torch)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass

from dynabatch.commands.bench import (
    BASELINES, DEFAULT_METHODS, METHODS, NORECOMPUTE, OWN_BASE, PEER_PLANS_AS, PROFILED, SLICED, as_argv, flag_names)
from dynabatch.commands.bench_report import PACK_ROWS_OF, PEER, PLAN_VARIANTS, print_progress, print_table, summary_line
from dynabatch.commands.bench_data import LazyPlans, load_batches
from dynabatch.commands.bench_layouts import ListBatcher, choose_layouts, placed_chunks, placed_methods
from dynabatch.commands.bench_results import results
from dynabatch.commands.common import check_length_flags, check_output_file, parse_methods, write_json
from dynabatch.training.config.resolve import Found, Resolved, lower, lower_args, resolve
from dynabatch.data.tokenize import load_tokenizer, tokenizer_info
from dynabatch.data.baselines import BASELINES as BASELINE_SPECS
from dynabatch.data.baselines import BaselineOptions
from dynabatch.core.allocator import host_memory_gib
from dynabatch.core.methods import CAUSAL_ONLY, check_method_family
from dynabatch.model_presets import FAMILY_PRESETS
from dynabatch.sequence import is_seq2seq
from dynabatch.data.batching import MIN_LENGTH_LIMIT, LengthLimits
from dynabatch.commands.tuning import sweep_results, sweep_settings, tuned_key, with_tuned
from dynabatch.training.config import TrainConfig
from dynabatch.models.attention_kernels import kernel_problem, use_attention_kernel
from dynabatch.models.families import check_model
from dynabatch.models.split import build_stage, pipeline_spec_for
from dynabatch.training.calibration import gather_measurements, quick_calibration, stage_times
from dynabatch.engine.dist import shutdown
from dynabatch.engine.faults import INTERRUPTED_STATUS, fail_fast
from dynabatch.engine.executor import Executor
from dynabatch.engine.launch import launch_local
from dynabatch.model_presets import stages_problem
from dynabatch.commands.output_files import profile_file_problem
from dynabatch.training.metrics import peak_rss_bytes
from dynabatch.training.planner import StepPlanner
from dynabatch.engine.precision import autocast_dtype
from dynabatch.engine.step import train_step
from dynabatch.engine.torch_pipelining import TorchPipeliningPeer, fixed_shape_inputs
from dynabatch.training.trainer import build_run_model, connect, planner_cost_model, run_calibration, run_process_settings

def resolve_defaults(args: argparse.Namespace) -> None:
    """Model aliases, the length-dependent default of ``--max-target-len`` and the search names of a resolved
    configuration in the planners' spelling (in place)."""
    lower_args(args)
    args.model = FAMILY_PRESETS.get(args.model, args.model)
    if args.methods is None:
        seq2seq = is_seq2seq(_family(args.model))
        sliced = not seq2seq and not args.cost_profile  # slices are priced analytically
        args.methods = ",".join(m for m in DEFAULT_METHODS
                                if (m != SLICED or sliced) and not (seq2seq and m in CAUSAL_ONLY))
    check_length_flags(args)  # the one rule, before the default below is derived and before any launch
    if args.max_target_len is None:
        args.max_target_len = max(MIN_LENGTH_LIMIT, args.max_input_len // 4)


def _family(model: str) -> str:
    """The sequence kind (``causal``/``seq2seq``) of a preset name or a local checkpoint directory."""
    return check_model(model, None).sequence_kind


def run(args: argparse.Namespace) -> int:
    resolve_defaults(args)
    check_output_file(args.json, command="bench")
    named = args.methods is not None and PROFILED in {m.strip() for m in args.methods.split(",")}
    if named and not args.compare_profile:  # it was "unknown method", though the report and --help name it
        raise ValueError(f"{PROFILED} is dynamic planned with a `dynabatch profile` JSON: pass --compare-profile "
                         f"PROFILE.json (which adds {PROFILED} by itself), or drop it from --methods")
    methods = parse_methods(args.methods, (*METHODS, PROFILED) if named else METHODS)
    if args.data and args.lengths:
        raise ValueError(f"give --data or --lengths, not both (got {args.data!r} and {args.lengths!r})")
    if args.columns and not args.data:
        raise ValueError("--columns maps the columns of --data; pass --data FILE")
    if args.compare_profile and PROFILED not in methods:
        methods.append(PROFILED)
    family = _family(args.model)
    for m in methods:  # dynamic_sliced, packing_free_split: decoder-only
        check_method_family(m.split("@")[0], family, args.model)
    for flag, value, least in (("--timed-steps", args.timed_steps, 1), ("--untimed-steps", args.untimed_steps, 0),
                               ("--stages", args.stages, 1), ("--tune-steps", args.tune_steps, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if (problem := stages_problem(args.model, args.stages)) is not None:  # before the launch, not once per rank
        raise ValueError(problem)
    for flag in ("--cost-profile", "--compare-profile"):
        if (problem := profile_file_problem(getattr(args, flag[2:].replace("-", "_"), None), flag)) is not None:
            raise ValueError(problem)
    if args.stages > 1 and "RANK" not in os.environ:
        method_configs(args, methods, found_here(args))  # checked once here, not once per rank after the launch
        code = launch_local(["-m", "dynabatch", "bench", *as_argv(args)], args.stages)
        if code == INTERRUPTED_STATUS:  # Ctrl-C: the ranks are stopped; the CLI says so in one line
            raise KeyboardInterrupt
        return code
    result = bench(args, methods)
    if result is None:
        return 0
    if args.json and write_json(result, args.json, indent=1, command="bench"):
        return 0
    if not args.quiet:
        print_table(result)
    print(summary_line(result), flush=True)
    return 0


@dataclass
class _Method:
    name: str
    executor: object
    """Our :class:`Executor`, or the :class:`TorchPipeliningPeer` for ``pipelining``."""
    planned: list
    spec: object
    cfg: object
    peer_steps: list | None = None
    """``pipelining`` only: per step ``(num micro-batches, (rows, E, D), global loss tokens, inputs)``
    (inputs on rank 0 only)."""
    placement: object = None
    """Virtual stages (``METHOD@PLACEMENT``): the :class:`~dynabatch.schedule.placement.Placement` it runs on."""


def method_configs(args, methods: list[str], found: Found) -> dict[str, Resolved]:
    """Each method's TrainConfig (``pipelining``: packing's), resolved by the resolver's rules
    (:func:`~dynabatch.training.config.resolve.resolve`) with what this process finds, as ``train`` resolves its own:
    every ``auto`` decided per method (a baseline's ``--recompute auto``: none)."""
    return {m: resolve(_config(args, PEER_PLANS_AS if m == PEER else m), found) for m in methods}


def base_config(args):
    """The configuration of the cost model every method shares (the dynamic method's, resolved)."""
    return resolve(_config(args, "dynamic"), found_here(args)).config


def found_here(args) -> Found:
    """What a bench process finds before it decides: CUDA or not, the model's sequence kind, the world size, the
    host's memory."""
    import torch

    return Found(cuda_available=torch.cuda.is_available(), sequence_kind=_family(args.model), world_size=args.stages,
                 host_memory_gib=host_memory_gib())


def resolved_json(resolved: dict[str, Resolved]) -> dict:
    """The JSON's ``resolved``: per method, ``{field: [value, reason]}``."""
    return {m: {name: [getattr(r.config, name), why] for name, why in r.reasons.items()} for m, r in resolved.items()}


def _moves(args, method: str) -> bool:
    """Whether ``method`` runs with stage boundaries that move per micro-batch: the dynamic methods under
    ``--moving-boundaries``, the baselines too with ``--moving-baselines`` (never the torch pipelining peer)."""
    if not getattr(args, "moving_boundaries", False) or method == PEER:
        return False
    return getattr(args, "moving_baselines", False) or method in ("dynamic", SLICED, *PACK_ROWS_OF, *OWN_BASE,
                                                                  *PLAN_VARIANTS)


def _config(args, method: str):
    return TrainConfig(
        moving_boundaries=_moves(args, method),
        model=args.model, tokenizer=args.tokenizer, attention_kernel=args.attention_kernel, stages=args.stages, method="dynamic" if method in (SLICED, *PACK_ROWS_OF, *OWN_BASE, *PLAN_VARIANTS) else method,
        policy=args.policy,
        global_batch_tokens=args.global_batch_tokens, max_input_len=args.max_input_len,
        max_target_len=args.max_target_len, **dataclasses.asdict(BaselineOptions.of(args)), memory_gib=args.memory_gib,
        threads=args.threads, cpu_allocator=getattr(args, "cpu_allocator", "auto"), seed=args.seed, max_steps=args.untimed_steps + args.timed_steps, warmup_steps=0, lr_scheduler_type="constant",
        timeline=False, cost_profile=args.compare_profile if method == PROFILED else getattr(args, "cost_profile", None),
        slice_long=method == SLICED, attention=args.attention, pack_rows=PACK_ROWS_OF.get(method, args.pack_rows),
        calibrate="off" if method in OWN_BASE else getattr(args, "calibrate", "auto"),
        plan_costs=PLAN_VARIANTS.get(method, getattr(args, "plan_costs", "auto")),
        recompute="none" if method == NORECOMPUTE else getattr(args, "recompute", "auto"),
        dtype=getattr(args, "dtype", "fp32"), layer_split=getattr(args, "layer_split", "data"),
        split_blocks=getattr(args, "split_blocks", "auto"),
        timeout_s=getattr(args, "timeout_s", 120.0),  # long micro-batches on a busy CPU: raise it (--timeout-s)
        # a --pack-rows variant measures that row layout: it runs the DP's plans, never a baseline's
        plan_candidates="off" if method in PACK_ROWS_OF else getattr(args, "plan_candidates", "baselines"),
    )


def _peer_steps(planned: list, spec, rows: int, is_planner: bool, group) -> list:
    """The ``pipelining`` method's steps from packing's planned steps: fixed-shape inputs on rank 0, and the
    micro-batch count, shape and loss-token count broadcast to every rank (before the timed loop).

    ``Schedule1F1B`` needs at least as many micro-batches as stages: a step with fewer packed rows than
    ``rows`` x stages gets ``ceil(rows of the step / stages)`` rows per micro-batch instead."""
    import torch.distributed as dist

    meta: list = [None]
    inputs = []
    if is_planner:
        meta[0] = []
        for p in planned:
            (mbs,) = p.replica_micro_batches
            total = sum(mb.shape[0] for mb in mbs)
            b = rows if -(-total // rows) >= spec.num_stages else -(-total // spec.num_stages)
            x, num = fixed_shape_inputs(list(mbs), spec, b)
            e_d = (*mbs[0].shape[1:], 0)[:2]
            meta[0].append((num, (b, *e_d), sum(mb.num_loss_tokens for mb in mbs)))
            inputs.append(x)
    dist.broadcast_object_list(meta, src=0, group=group)
    return [(*m, inputs[i] if is_planner else None) for i, m in enumerate(meta[0])]


def _run_step(r: _Method, ctx, step: int, planned) -> tuple[float, int | None, object]:
    """One training step of method ``r``; returns its loss (on rank 0), this rank's peak bytes saved for
    backward (``None`` for the torch pipelining peer, which is not metered) and the executor's
    :class:`~dynabatch.engine.executor.StepResult` (``None`` for the peer)."""
    if r.peer_steps is not None:
        num, shape, tokens, inputs = r.peer_steps[step]
        return r.executor.step(num, shape, tokens, inputs), None, None
    result = train_step(
        r.executor, ctx, step, planned.replica_micro_batches if planned else None, spec=r.spec,
        policy=lower("policy", r.cfg.policy), costs=planned.costs if planned else None, memory_limit_bytes=r.cfg.memory_gib * 2**30,
        schedules=planned.schedules if planned else None,
        slice_links=planned.slice_links if planned else None,
        model_state_bytes=planned.model_state_bytes if planned else 0.0, placement=r.placement,
    )
    return float(result.loss), result.saved_peak_bytes, result


def bench(args, methods: list[str]) -> dict | None:
    """Build one executor per method, plan every step, run the steps interleaved; rank 0 returns results."""
    resolved = method_configs(args, methods, found_here(args))
    with run_process_settings(resolved[methods[0]].config):  # one allocator setting for every method
        return _measure(args, methods, resolved)


def _measure(args, methods: list[str], resolved: dict[str, Resolved]) -> dict | None:
    """:func:`bench` of the methods' resolved configurations."""
    ctx = connect(resolved[methods[0]].config)
    try:
        with fail_fast(ctx, "dynabatch bench"):  # a failing rank: its own line, the job ends at once
            return _measure_connected(args, methods, resolved, ctx)
    finally:
        shutdown()


def _measure_connected(args, methods: list[str], resolved: dict[str, Resolved], ctx) -> dict | None:
    """:func:`_measure` on the connected ranks (``ctx``); rank 0 returns the results."""
    import copy

    import torch
    import torch.distributed as dist

    cfgs = {m: r.config for m, r in resolved.items()}
    cfg0 = cfgs[methods[0]]
    num_steps = args.untimed_steps + args.timed_steps
    torch.set_num_threads(args.threads)
    kernel = lower("attention_kernel", cfg0.attention_kernel)
    if problem := kernel_problem(kernel, ctx.device, args.dtype):
        raise ValueError(problem)
    use_attention_kernel(kernel)
    info = tokenizer_info(load_tokenizer(cfg0.tokenizer, args.model))
    family = check_model(args.model, args.max_input_len).sequence_kind
    model = build_run_model(args.model, cfg0.tokenizer, info, family, seed=args.seed)
    limits = LengthLimits(family, max_input_len=args.max_input_len, max_target_len=args.max_target_len,
                          max_seq_len=args.max_input_len)
    batches = load_batches(args, family, limits, info, num_steps) if ctx.is_planner else []
    layouts = choose_layouts(args, methods, cfgs, base_config(args), model, batches, limits, info, ctx)  # collective
    layout = layouts["linear"].layout
    spec = pipeline_spec_for(model, layout, "float32")
    base = [build_stage(model, layout, ctx.stage_index)]
    moving = [build_stage(model, layout, ctx.stage_index, moving_boundaries=True)] \
        if any(c.moving_boundaries for c in cfgs.values()) else base  # the units beside each cut held on both sides
    placed = placed_chunks(layouts, model, ctx.stage_index)  # placement -> (layout, spec, this rank's chunks)

    def new_run(name: str, cfg, measure_memory: bool = True, placement=None) -> _Method:
        """Collective: every rank builds the runs in the same order."""
        own_layout, own_spec, chunks = placed[placement.describe()] if placement is not None else \
            (layout, spec, moving if cfg.moving_boundaries else base)
        chunks = [copy.deepcopy(c).to(ctx.device) for c in chunks]
        for c in chunks:
            c.attention = cfg.attention_path  # the copy's HF attention serves segments and dense masks
        opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=cfg.learning_rate,
                                weight_decay=cfg.weight_decay)
        dtype = autocast_dtype(cfg.dtype)
        if name == PEER:
            ex = TorchPipeliningPeer(chunks[0], spec, ctx, opt, max_grad_norm=cfg.max_grad_norm, autocast_dtype=dtype)
        else:
            ex = Executor(chunks, ctx, opt, max_grad_norm=cfg.max_grad_norm, dropout_seed=args.seed,
                          measure_memory=measure_memory, autocast_dtype=dtype)
        return _Method(name, ex, [], own_spec, cfg, placement=placement)

    runs: dict[str, _Method] = {m: new_run(m, cfgs[m]) for m in methods}
    for key, (placement, m) in placed_methods(args, methods).items():
        runs[key] = new_run(key, cfgs[m], placement=placement)
    cost_model = None
    calibrated = [m for m in methods if m not in (PEER, *OWN_BASE)] if args.calibrate != "off" else []
    calibrated += [key for key, (_, m) in placed_methods(args, methods).items() if m in calibrated]
    fits: dict[str, object] = {}  # rank 0: placement ("" = linear) -> the fit its calibrated methods share

    def fit_of(key: str):
        return fits[key.partition("@")[2]]

    calibration = None
    if ctx.is_planner:
        cost_model = planner_cost_model(base_config(args), model.config, layout)  # the base every method shares
        if calibrated:  # one fit shared by the calibrated methods, set up as the trainer's
            calibration, _ = run_calibration(cfgs[calibrated[0]], cost_model, model.config.to_dict(), layout)
            fits[""] = calibration

    def plan(cfg, n: int) -> list:
        """Rank 0: ``n`` planned steps of ``cfg``'s method over the global batches."""
        planner = StepPlanner(ListBatcher(batches, limits), cfg, cost_model, info)
        return [planner() for _ in range(n)]

    if ctx.is_planner:
        for m in methods:
            if m in calibrated:  # planned step by step, each with the fit as of plan_ahead + 1 steps before
                runs[m].planned = LazyPlans(StepPlanner(ListBatcher(batches, limits), cfgs[m], cost_model, info,
                                                         calibration=calibration), num_steps)
            elif m in OWN_BASE:  # planned ahead with their own base model
                own = planner_cost_model(cfgs[m], model.config, layout)
                planner = StepPlanner(ListBatcher(batches, limits), cfgs[m], own, info)
                runs[m].planned = [planner() for _ in range(num_steps)]
            else:
                runs[m].planned = plan(cfgs[m], num_steps)
        for key, (placement, m) in placed_methods(args, methods).items():  # planned with their chunks' costs
            name = placement.describe()
            chunk_layout = placed[name][0]
            own = planner_cost_model(cfgs[m], model.config, chunk_layout)
            # the planner orders each step on the placement (sends priced), and the runtime runs those orders
            placed_cfg = dataclasses.replace(cfgs[m], placement=name)
            if key in calibrated:  # one fit per placement, a coefficient set per chunk
                if name not in fits:
                    fits[name], _ = run_calibration(placed_cfg, own, model.config.to_dict(), chunk_layout)
                runs[key].planned = LazyPlans(StepPlanner(ListBatcher(batches, limits), placed_cfg, own, info,
                                                           calibration=fits[name]), num_steps)
            else:
                planner = StepPlanner(ListBatcher(batches, limits), placed_cfg, own, info)
                runs[key].planned = [planner() for _ in range(num_steps)]
    if PEER in runs:
        runs[PEER].peer_steps = _peer_steps(runs[PEER].planned, spec, args.packing_rows, ctx.is_planner,
                                            ctx.delivery_group)
    del model
    cuda = ctx.device.type == "cuda"
    tuned = {}
    if args.tune_baselines:
        tuned = _tune(args, [m for m in methods if m in BASELINES], cfgs, ctx, spec, batches, limits, new_run,
                      plan, runs, cuda)

        for key in [tuned_key(m) for m in BASELINES if tuned_key(m) in runs and calibrated]:  # calibrated too
            calibrated.append(key)
            if ctx.is_planner:
                runs[key].planned = LazyPlans(StepPlanner(ListBatcher(batches, limits), runs[key].cfg, cost_model,
                                                           info, calibration=calibration), num_steps)
    if calibrated and cfgs[calibrated[0]].calibration_mode == "quick":  # once per fit (placement), collective
        for placement_name in dict.fromkeys(key.partition("@")[2] for key in calibrated):
            first = runs[next(key for key in calibrated if key.partition("@")[2] == placement_name)]
            quick_calibration(first.executor, ctx, first.planned.planner if ctx.is_planner else None, first.spec, 0)
    order = list(runs)
    times = {m: [] for m in order}
    stage_compute = {m: [] for m in order}  # per timed step, replica 0's measured fwd + bwd seconds per stage
    losses = {m: [] for m in order}
    peaks = {m: 0 for m in order}
    saved = {m: None for m in order}
    last: dict[str, float] = {}  # each method's latest step time, for the progress line
    for step in range(num_steps):
        k = step % len(order)
        for m in order[k:] + order[:k]:  # rotated order: no method always runs first
            r = runs[m]
            planned = r.planned[step] if ctx.is_planner else None
            elapsed, loss, saved_peak, peak, result = _timed_step(r, ctx, step, planned, cuda)
            if result is not None:  # every method on our executor: measured compute per stage
                gathered = gather_measurements(ctx, result)  # collective, outside the timed region
                if ctx.is_planner:
                    if step >= args.untimed_steps:
                        stage_compute[m].append(stage_times(ctx, gathered))
                    if m in calibrated:
                        fit_of(m).record(ctx, planned, gathered, elapsed)
            if saved_peak is not None and step >= args.untimed_steps:
                saved[m] = max(saved[m] or 0, saved_peak)
            peaks[m] = max(peaks[m], peak)
            if step >= args.untimed_steps:
                times[m].append(elapsed)
            losses[m].append(loss)
            last[m] = elapsed
        if ctx.is_planner:
            print_progress(step, num_steps, step >= args.untimed_steps, last)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (peaks, saved), group=ctx.delivery_group)
    if not ctx.is_planner:
        return None
    measured_peak = {m: max(p[m] for p, _ in gathered) for m in order} if cuda else None
    measured_saved = {m: max((s[m] for _, s in gathered if s[m] is not None), default=None) for m in order}
    result = results(args, order, runs, times, losses, measured_peak, peak_rss_bytes(), cost_model, batches,
                     str(ctx.device), measured_saved, calibrated, stage_compute, flag_names())
    result["layouts"] = {k: v.layout.describe() for k, v in layouts.items()}
    result["resolved"] = resolved_json(resolved)
    if not args.tune_baselines:
        return result

    return with_tuned(result, tuned)


def _timed_step(r: _Method, ctx, step: int, planned, cuda: bool) -> tuple[float, float, int | None, int, object]:
    """``barrier; t0; train_step; barrier; t1``: ``(seconds, loss, saved-for-backward peak, CUDA peak bytes,
    StepResult)``."""
    import torch
    import torch.distributed as dist

    if cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    dist.barrier(group=ctx.delivery_group)
    t0 = time.perf_counter()
    loss, saved_peak, result = _run_step(r, ctx, step, planned)
    if cuda:
        torch.cuda.synchronize(ctx.device)
    dist.barrier(group=ctx.delivery_group)
    elapsed = time.perf_counter() - t0
    return elapsed, loss, saved_peak, int(torch.cuda.max_memory_allocated(ctx.device)) if cuda else 0, result


def _tune(args, baselines, cfgs, ctx, spec, batches, limits, new_run, plan, runs, cuda) -> dict:
    """``--tune-baselines`` (:mod:`dynabatch.commands.tuning`): sweep every baseline's knob on one scratch
    executor, then add a run of each baseline's best value (when it is not the default) to ``runs``.
    Returns the rank-0 :class:`~dynabatch.commands.tuning.Tuned` per baseline (``{}`` on other ranks)."""
    import torch.distributed as dist


    warmup = min(args.untimed_steps, 1)
    sweep_steps = warmup + args.tune_steps
    skipped, candidates, meta = {}, [], [None]
    if ctx.is_planner:
        skipped, candidates = sweep_settings(baselines, cfgs, args, batches[:sweep_steps], limits,
                                             lambda cfg: plan(cfg, sweep_steps), spec)
        meta[0] = [cfg for _, _, cfg, _ in candidates]
    dist.broadcast_object_list(meta, src=0, group=ctx.delivery_group)
    cfg_of = meta[0]
    times: list[list[float]] = [[] for _ in cfg_of]
    if cfg_of:  # one scratch executor for every value: the step time does not depend on the weights
        scratch = new_run("sweep", cfg_of[0], measure_memory=False).executor
        sweep = [_Method(f"sweep{k}", scratch, candidates[k][3] if ctx.is_planner else [], spec, cfg)
                 for k, cfg in enumerate(cfg_of)]
        for step in range(sweep_steps):
            k0 = step % len(sweep)
            for k in [*range(k0, len(sweep)), *range(k0)]:  # rotated, like the timed loop
                elapsed = _timed_step(sweep[k], ctx, step, sweep[k].planned[step] if ctx.is_planner else None, cuda)[0]
                if step >= warmup:
                    times[k].append(elapsed)
        del sweep, scratch
    tuned = sweep_results(baselines, args, skipped, candidates, times) if ctx.is_planner else {}
    choices: list = [{m: t.value for m, t in tuned.items() if t.value is not None and t.value != t.default}]
    dist.broadcast_object_list(choices, src=0, group=ctx.delivery_group)
    for m, value in choices[0].items():
        cfg = dataclasses.replace(cfgs[m], **{BASELINE_SPECS[m].option: value})
        runs[tuned_key(m)] = new_run(tuned_key(m), cfg)
        if ctx.is_planner:
            runs[tuned_key(m)].planned = plan(cfg, args.untimed_steps + args.timed_steps)
    return tuned
