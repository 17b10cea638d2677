"""Atomic, verified checkpoints: crash during save, corruption, fallback, weights-only loading; run ids
and pruning, non-finite weights, a full disk, export guards."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch

from dynabatch.runtime.checkpoint import (
    RUN_ID_FILE,
    CheckpointError,
    CheckpointWriteError,
    NonFiniteError,
    first_non_finite,
    folder_run_id,
    latest_checkpoint,
    list_checkpoints,
    load_shard,
    new_run_id,
    prune,
    save_collective,
    save_shard,
    step_dir,
    verify,
    write_manifest,
)


def _save(root, step, ranks=2, value=0.0, run_id="run-a", **extra):
    shards = [save_shard(root, step, r, {"w": torch.full((3,), value + r), "step": step}) for r in range(ranks)]
    write_manifest(str(root), step, shards, {"data": {"pending": None}, "run_id": run_id, "finite": True, **extra})


def _one_rank(obj) -> list:
    """``gather`` of a world of one rank."""
    return [obj]


def _steps(root) -> list[int]:
    return [int(os.path.basename(p)[5:]) for p in list_checkpoints(str(root))]


def test_round_trip_and_latest(tmp_path):
    _save(tmp_path, 10, value=1.0)
    _save(tmp_path, 20, value=2.0)
    info = latest_checkpoint(str(tmp_path))
    assert info.step == 20 and info.manifest["data"] == {"pending": None}
    assert torch.equal(load_shard(info, 1)["w"], torch.full((3,), 3.0))


def test_crash_before_manifest_falls_back(tmp_path):
    _save(tmp_path, 10)
    save_shard(tmp_path, 20, 0, {"w": torch.zeros(2)})  # rank 1 never wrote, no manifest
    with pytest.warns(UserWarning, match="incomplete"):
        info = latest_checkpoint(str(tmp_path))
    assert info.step == 10
    with pytest.raises(CheckpointError, match="incomplete"):
        latest_checkpoint(str(tmp_path), fallback=False)


def test_crash_while_writing_leaves_previous_file(tmp_path):
    _save(tmp_path, 10, value=5.0)

    class Boom(Exception):
        pass

    def exploding_save(obj, f):
        f.write(b"partial bytes")
        raise Boom

    real = torch.save
    torch.save = exploding_save
    try:
        with pytest.raises(Boom):
            save_shard(tmp_path, 10, 0, {"w": torch.zeros(3)})
    finally:
        torch.save = real
    assert not [n for n in os.listdir(step_dir(tmp_path, 10)) if n.startswith(".tmp-")]
    info = verify(step_dir(tmp_path, 10))  # the old shard is intact
    assert torch.equal(load_shard(info, 0)["w"], torch.full((3,), 5.0))


def test_truncated_shard_detected(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    shard = os.path.join(step_dir(tmp_path, 20), "rank-00001.pt")
    with open(shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        verify(step_dir(tmp_path, 20))
    with pytest.warns(UserWarning):
        assert latest_checkpoint(str(tmp_path)).step == 10


class NotATensor:
    """A pickled class instance: weights-only loading must refuse it."""


def test_weights_only_refuses_code(tmp_path):
    shards = [save_shard(tmp_path, 1, 0, {"obj": NotATensor()})]
    write_manifest(str(tmp_path), 1, shards, {})
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_shard(verify(step_dir(tmp_path, 1)), 0)


def test_missing_rank_and_prune(tmp_path):
    for s in (1, 2, 3):
        _save(tmp_path, s)
    with pytest.raises(CheckpointError, match="no shard for rank 5"):
        load_shard(latest_checkpoint(str(tmp_path)), 5)
    prune(str(tmp_path), keep=1, run_id="run-a")
    assert sorted(os.listdir(tmp_path)) == ["step-000003"]


def test_save_collective_records_run_id_and_finiteness(tmp_path):
    run_id = new_run_id()
    assert len(run_id) == 16 and int(run_id, 16) >= 0 and new_run_id() != run_id
    folder = save_collective(str(tmp_path), 4, 0, {"stage": {"w": torch.ones(2)}, "step": 4}, gather=_one_rank,
                             manifest_extra={"data": None}, run_id=run_id, keep=2)
    info = verify(folder)
    assert info.run_id == run_id and info.manifest["finite"] is True and info.step == 4
    assert folder_run_id(folder) == run_id
    assert torch.equal(load_shard(info, 0)["stage"]["w"], torch.ones(2))


def test_prune_only_touches_this_run(tmp_path):
    # An old run's checkpoints at higher steps, a legacy one without run id, a folder of no known run,
    # then a new run saves 2, 4, 6 with keep=2.
    _save(tmp_path, 8, run_id="old")
    _save(tmp_path, 10, run_id="old")
    _save(tmp_path, 12, run_id=None)
    os.makedirs(step_dir(tmp_path, 14))  # incomplete, of no known run
    os.makedirs(step_dir(tmp_path, 1))
    with open(os.path.join(step_dir(tmp_path, 1), RUN_ID_FILE), "w") as f:
        f.write("new")  # the new run's own unfinished save
    for step in (2, 4, 6):
        save_collective(str(tmp_path), step, 0, {"w": torch.zeros(1)}, gather=_one_rank, manifest_extra={},
                        run_id="new", keep=2)
    assert _steps(tmp_path) == [4, 6, 8, 10, 12, 14]
    assert [folder_run_id(step_dir(tmp_path, s)) for s in (4, 6, 8, 10, 12, 14)] == ["new", "new", "old", "old", None, None]
    with pytest.raises(ValueError, match="needs the id of the run"):
        prune(str(tmp_path), 1, None)


def test_prune_never_deletes_the_newest_finite_checkpoint(tmp_path):
    _save(tmp_path, 2, run_id="r")
    _save(tmp_path, 4, run_id="r", finite=False)  # as no save writes them: written by hand
    _save(tmp_path, 6, run_id="r", finite=False)
    prune(str(tmp_path), keep=1, run_id="r")
    assert _steps(tmp_path) == [2, 6]


def test_first_non_finite_names_the_tensor():
    state = {"stage": {"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}, "rng": torch.zeros(3, dtype=torch.uint8),
             "optimizer": {"state": {0: {"exp_avg": torch.ones(1)}}}, "step": 3}
    assert first_non_finite(state) == "stage.b"
    state["stage"]["b"] = torch.ones(2)
    assert first_non_finite(state) is None
    state["optimizer"]["state"][0]["exp_avg"] = torch.tensor([float("nan")])
    assert first_non_finite(state) == "optimizer.state.0.exp_avg"


def _threaded_save(root, step, states, **kw):
    """Run save_collective on len(states) ranks as threads that gather through a barrier (like
    all_gather_object); returns each rank's result or exception."""
    world = len(states)
    slots: list = [None] * world
    barrier = threading.Barrier(world, timeout=30)
    results: list = [None] * world

    def gather_for(rank):
        def gather(obj):
            barrier.wait()
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return gather

    def run(rank):
        try:
            results[rank] = save_collective(str(root), step, rank, states[rank], gather=gather_for(rank),
                                            manifest_extra={}, run_id="r" if rank == 0 else None, keep=2, **kw)
        except Exception as e:  # noqa: BLE001 - handed to the test
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_non_finite_on_one_rank_writes_nothing_on_any(tmp_path):
    _save(tmp_path, 2, run_id="r")
    states = [{"stage": {"w": torch.ones(2)}}, {"stage": {"w": torch.tensor([0.0, float("nan")])}}]
    results = _threaded_save(tmp_path, 4, states)
    for e in results:  # every rank raises the same line
        assert isinstance(e, NonFiniteError) and isinstance(e, ValueError), e
        assert str(e) == str(results[0])
    msg = str(results[0])
    assert "step 4" in msg and "rank 1 'stage.w'" in msg and "rank 0" not in msg and "Lower --lr" in msg
    assert _steps(tmp_path) == [2] and verify(step_dir(tmp_path, 2)).step == 2


def _disk_full_on(thread_name: str):
    real = torch.save

    def save(obj, f):
        if threading.current_thread().name == thread_name:
            f.write(b"half a shard")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(obj, f)

    return save


def test_disk_full_on_one_rank_leaves_no_partial_folder(tmp_path, monkeypatch):
    _save(tmp_path, 2, run_id="r")
    monkeypatch.setattr(torch, "save", _disk_full_on("rank-1"))
    results = _threaded_save(tmp_path, 4, [{"w": torch.ones(1)}, {"w": torch.ones(1)}])
    for e in results:
        assert isinstance(e, CheckpointWriteError) and isinstance(e, ValueError), e
    msg = str(results[0])
    assert step_dir(tmp_path, 4) in msg and "rank 1: No space left on device (ENOSPC)" in msg
    assert "free disk space" in msg and "--resume" in msg and "--output-dir" in msg
    assert _steps(tmp_path) == [2] and verify(step_dir(tmp_path, 2)).step == 2


def test_disk_full_keeps_a_folder_this_save_did_not_create(tmp_path, monkeypatch):
    os.makedirs(step_dir(tmp_path, 4))
    (tmp_path / "step-000004" / "notes.txt").write_text("not ours")
    monkeypatch.setattr(torch, "save", _disk_full_on(threading.current_thread().name))
    with pytest.raises(CheckpointWriteError, match="rank 0: No space left on device"):
        save_collective(str(tmp_path), 4, 0, {"w": torch.ones(1)}, gather=_one_rank, manifest_extra={}, run_id="r", keep=1)
    assert sorted(os.listdir(step_dir(tmp_path, 4))) == ["notes.txt", RUN_ID_FILE]


def test_read_only_checkpoint_folder(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders (the ENOSPC tests cover the same path)")
    _save(tmp_path, 2, run_id="r")
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(CheckpointWriteError, match=r"Permission denied \(EACCES\).*free disk space"):
            save_collective(str(tmp_path), 4, 0, {"w": torch.ones(1)}, gather=_one_rank, manifest_extra={},
                            run_id="r", keep=1)
    finally:
        os.chmod(tmp_path, 0o755)
    assert _steps(tmp_path) == [2]


# --- export -------------------------------------------------------------------------------------------


def _model_checkpoint(root, step: int, poison: str | None = None):
    """A one-stage t5-tiny checkpoint as an older dynabatch wrote it (no finiteness check): with ``poison``
    (a stage parameter name) holding a NaN. Returns (folder, stage)."""
    from dynabatch.config import TrainConfig
    from dynabatch.data.tokenize import load_tokenizer, tokenizer_info
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import build_stage, layout_for

    cfg = TrainConfig(model="t5-tiny", tokenizer="byt5", output_dir=str(root))
    model = build_model(cfg.model, vocab_size=tokenizer_info(load_tokenizer(cfg.tokenizer)).vocab_size, seed=1)
    stage = build_stage(model, layout_for(model, 1), 0)
    weights = {k: v.clone() for k, v in stage.state_dict().items()}
    if poison:
        weights[poison].view(-1)[0] = float("nan")
    shards = [save_shard(str(root), step, 0, {"stage": weights})]
    write_manifest(str(root), step, shards, {"config": cfg.to_dict(), "run_id": "r"})
    return step_dir(root, step), stage


def _cli(capsys, *args) -> tuple[int, str]:
    from dynabatch.cli import main

    code = main(list(args))
    return code, capsys.readouterr().err


def test_export_refuses_non_finite_weights(tmp_path, capsys):
    _, probe = _model_checkpoint(tmp_path / "probe", 1)
    local = next(name for name in probe.parameter_map if "block" in name)
    folder, _ = _model_checkpoint(tmp_path / "ckpt", 2, poison=local)
    out = tmp_path / "hf"
    code, err = _cli(capsys, "export", str(tmp_path / "ckpt"), str(out))
    lines = [line for line in err.splitlines() if line.startswith("dynabatch export: error:")]
    assert code == 2 and len(lines) == 1, err
    assert folder in lines[0] and repr(probe.parameter_map[local]) in lines[0] and "non-finite" in lines[0]
    assert not out.exists()


def test_export_guards_its_output_folder(tmp_path, capsys):
    _model_checkpoint(tmp_path / "ckpt", 2)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, err = _cli(capsys, "export", str(tmp_path / "ckpt"), str(out))
    assert code == 2 and "is not empty and holds no earlier export (it holds mine.txt)" in err and "--force" in err
    assert os.listdir(out) == ["mine.txt"]
    (tmp_path / "file").write_text("x")
    code, err = _cli(capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "file"))
    assert code == 2 and "is a file, not a folder" in err
    assert _cli(capsys, "export", str(tmp_path / "ckpt"), str(out), "--force")[0] == 0
    assert (out / "mine.txt").read_text() == "keep me"
    with open(out / "dynabatch_export.json") as f:
        assert json.load(f)["step"] == 2
    assert _cli(capsys, "export", str(tmp_path / "ckpt"), str(out))[0] == 0  # an earlier export: rewritten


# --- through `dynabatch train` ------------------------------------------------------------------------

TRAIN = ["train", "--model", "t5-tiny", "--tokenizer", "byt5", "--global-batch-tokens", "1024", "--max-input-len", "128",
         "--max-target-len", "32", "--log-every", "0", "--no-timeline", "--task-loss-every", "0"]


def test_train_keeps_one_run_id_across_resume_and_prunes_only_it(tmp_path, capsys, toy_mixture_dir):
    out = tmp_path / "run"
    common = [*TRAIN, "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir", str(out),
              "--checkpoint-every", "1", "--keep-checkpoints", "1"]
    assert _cli(capsys, *common, "--steps", "2")[0] == 0
    root = out / "checkpoints"
    assert _steps(root) == [2]
    first = verify(step_dir(root, 2))
    assert first.manifest["finite"] is True and len(first.run_id) == 16
    _save(root, 1, run_id="another-run")  # not this run's: pruning must leave it
    code, err = _cli(capsys, *common, "--steps", "3", "--resume")
    assert code == 0, err[-2000:]
    assert _steps(root) == [1, 3] and verify(step_dir(root, 3)).run_id == first.run_id


def test_disk_full_during_train_is_one_line_and_exit_2(tmp_path, capsys, toy_mixture_dir, monkeypatch):
    def full(obj, f):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    code, err = _cli(capsys, *TRAIN, "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
                     "--output-dir", str(tmp_path / "run"), "--steps", "1")
    lines = [line for line in err.splitlines() if line.startswith("dynabatch train: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert f"could not write checkpoint {step_dir(tmp_path / 'run' / 'checkpoints', 1)}" in lines[0]
    assert "No space left on device (ENOSPC)" in lines[0] and "free disk space" in lines[0]
    assert _steps(tmp_path / "run" / "checkpoints") == []
