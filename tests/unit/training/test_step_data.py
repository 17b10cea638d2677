"""Every rank collates its own micro-batches (:mod:`dynabatch.training.step_data`): a replica's layout, made of rank
0's planned step, names no class and no token, and another process holding the same data makes of it exactly the
micro-batches the planner laid out (the planned shapes, the tensors, the loss tokens), for the dynamic method on
two replicas (T5), with token slices (GPT) and for a baseline that cuts samples into chunks (packing_free_split);
the planner process's parent rebuilds the same batch (:meth:`~dynabatch.training.planner.StepPlanner.with_data`)."""

from __future__ import annotations

import pickle
import pickletools

import pytest
import torch

from dynabatch.data.batching import GlobalBatcher, LengthLimits
from dynabatch.engine.step import micro_batch_shape
from dynabatch.models.presets import build_model
from dynabatch.models.split import layout_for
from dynabatch.training.config import TrainConfig
from dynabatch.training.planner import StepPlanner
from dynabatch.training.step_data import LAYOUT_VERSION, StepData
from dynabatch.training.trainer import planner_cost_model

CASES = {
    "t5-dynamic-2-replicas": ("t5", dict(model="t5-tiny", replicas=2, global_batch_tokens=2048, max_input_len=256,
                                         max_target_len=64)),
    "gpt2-token-slices": ("gpt2", dict(model="gpt2-tiny", global_batch_tokens=2048, max_input_len=512,
                                       slice_long=True, memory_gib=0.012)),
    "gpt2-packing-free-split": ("gpt2", dict(model="gpt2-tiny", global_batch_tokens=2048, max_input_len=512,
                                             method="packing_free_split", packing_free_split_tokens=64)),
}


def _batcher(data, cfg: TrainConfig) -> GlobalBatcher:
    limits = LengthLimits(data.family, max_input_len=cfg.max_input_len, max_target_len=cfg.max_target_len,
                          max_seq_len=cfg.max_input_len)
    return GlobalBatcher(data, limits, token_budget=cfg.global_batch_tokens)


@pytest.mark.parametrize("toy_data, case", [(family, name) for name, (family, _) in CASES.items()],
                         indirect=["toy_data"], ids=list(CASES))
def test_a_rank_collates_from_a_layout_what_the_planner_laid_out(toy_data, case):
    cfg = TrainConfig(stages=2, **CASES[case][1])
    model = build_model(cfg.model, vocab_size=toy_data.tokens.vocab_size)
    planner = StepPlanner(_batcher(toy_data, cfg), cfg, planner_cost_model(cfg, model.config, layout_for(model, 2)),
                          toy_data.tokens)
    rank0 = StepData(planner.batcher, cfg, toy_data.tokens)
    other = StepData(_batcher(toy_data, cfg), cfg, toy_data.tokens)  # another rank: its own batcher, never drawn
    sliced = chunks = 0
    for _ in range(6 if case == "gpt2-token-slices" else 3):
        planned = planner()
        sliced += planned.num_sliced_samples
        chunks += len(planned.batch) - len(planned.drawn)
        rebuilt = planner.with_data(planned.without_data()).batch  # what the planner process's parent does
        assert [(s.source_index, s.row_index) for s in rebuilt.samples] == [
            (s.source_index, s.row_index) for s in planned.batch.samples]
        assert all((a.input_ids == b.input_ids).all() and (a.target_ids == b.target_ids).all()
                   for a, b in zip(rebuilt.samples, planned.batch.samples, strict=True))
        layouts = rank0.layouts(planned)
        assert len(layouts) == cfg.replicas
        for r, layout in enumerate(layouts):
            assert pickle.loads(layout)[0] == LAYOUT_VERSION
            assert not [op for op, _, _ in pickletools.genops(layout) if "GLOBAL" in op.name or op.name == "REDUCE"]
            want, got = planned.replica_micro_batches[r], other.micro_batches(layout)
            assert tuple(micro_batch_shape(mb) for mb in got) == planned.shapes[r]
            assert [mb.sample_ids for mb in got] == [mb.sample_ids for mb in want] == list(planned.replica_rows[r])
            for a, b in zip(want, got, strict=True):
                assert type(a) is type(b)
                for name in vars(a):
                    if isinstance(getattr(a, name), torch.Tensor):
                        assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert rank0.micro_batches(layout)[0].sample_ids == want[0].sample_ids  # rank 0, from its own batch
        assert rank0.loss_tokens(planned) == sum(mb.num_loss_tokens for mbs in planned.replica_micro_batches
                                                 for mb in mbs)
    if case == "gpt2-token-slices":
        assert sliced > 0
    if case == "gpt2-packing-free-split":
        assert chunks > 0  # the baseline cut samples: the other rank rebuilt its chunks


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_a_layout_of_another_format_is_refused(toy_data):
    cfg = TrainConfig(model="gpt2-tiny", stages=2, global_batch_tokens=1024, max_input_len=128)
    data = StepData(_batcher(toy_data, cfg), cfg, toy_data.tokens)
    with pytest.raises(ValueError, match=f"a step layout of format {LAYOUT_VERSION + 1}, this dynabatch reads"):
        data.micro_batches(pickle.dumps((LAYOUT_VERSION + 1, 0, b"", 0, 0, ())))
