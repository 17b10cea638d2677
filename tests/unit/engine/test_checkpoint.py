"""Atomic, verified, reshardable checkpoints: crash during save, corruption, fallback, unlisted files, an
older format; run ids and pruning, non-finite weights, a full disk; global names and tied weights across
layouts; export guards; ``--resume-from-checkpoint PATH`` refusals."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from dynabatch.core.rank_warnings import EveryRankWarning
from dynabatch.engine.checkpoint import (
    MANIFEST,
    RUN_ID_FILE,
    CheckpointError,
    CheckpointWriteError,
    NonFiniteError,
    atomic_write,
    data_files,
    file_entry,
    first_non_finite,
    folder_run_id,
    latest_checkpoint,
    list_checkpoints,
    new_run_id,
    prune,
    resolve_checkpoint,
    save_collective,
    step_dir,
    verify,
    write_manifest,
)
from dynabatch.training.reshard import dcp_writer, load_stage_state, model_weights, stage_state


def _file_writer(rank: int, fail: OSError | None = None):
    """``write`` of one rank as plain safetensors (the threaded tests have no process group for DCP); with
    ``fail``, half a file and then that error."""
    def write(folder, state):
        path = os.path.join(folder, f"shard-{rank + 1:05d}.safetensors")
        if fail is not None:
            with open(path, "wb") as f:
                f.write(b"half a shard")
            raise fail
        save_file(state, path)
    return write


def _save(root, step, ranks=2, value=0.0, run_id="run-a", **extra):
    folder = step_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    for r in range(ranks):
        _file_writer(r)(folder, {f"model/w{r}": torch.full((3,), value + r)})
    write_manifest(str(root), step, [file_entry(folder, n) for n in data_files(folder)],
                   {"data": {"pending": None}, "run_id": run_id, "finite": True, **extra})


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
    weights = model_weights(info.path)  # read through DCP from both ranks' files
    assert sorted(weights) == ["w0", "w1"] and torch.equal(weights["w1"], torch.full((3,), 3.0))


def test_a_checkpoint_path_that_does_not_exist_names_the_ones_there(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 15)
    _save(root, 20)
    os.makedirs(step_dir(root, 25))  # an unfinished save (no manifest): not one to pass
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint(step_dir(root, 5))  # pruned, say
    assert str(e.value) == (f"checkpoint {step_dir(root, 5)!r} does not exist ({root} holds step-000015, step-000020; "
                            "a run keeps only its newest --save-total-limit checkpoints); pass one of those, or the "
                            "checkpoints/ folder for its newest")
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*/nowhere/step-000005' does not exist; pass a step-NNNNNN "
                                              r"folder \(with manifest.json\) or a run's checkpoints/ folder$"):
        resolve_checkpoint(str(tmp_path / "nowhere" / "step-000005"))
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint: pass"):  # a folder that exists but is none
        resolve_checkpoint(str(tmp_path / "other"))
    with pytest.raises(CheckpointError) as e:  # the run's folder: its checkpoints/ folder is what to pass
        resolve_checkpoint(str(tmp_path))
    assert str(e.value) == (f"{str(tmp_path)!r} is not a checkpoint but a run's folder: pass {root} for its newest "
                            "checkpoint, or one of the step-NNNNNN folders in it")


def test_a_run_folder_with_an_empty_checkpoints_folder_is_one_line_and_exit_2(tmp_path, capsys, toy_mixture_dir):
    """The run's output folder or its checkpoints/ folder, with no step folder in it: one line saying so, where,
    and what to do; ``dynabatch train`` exits 2."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    said = (f"no checkpoint in {run / 'checkpoints'}; start without --resume-from-checkpoint, or pass a step-NNNNNN "
            "folder or a checkpoints/ folder that holds one")
    for path in (run, run / "checkpoints"):
        with pytest.raises(CheckpointError) as e:
            resolve_checkpoint(str(path))
        assert str(e.value) == said
    code, err = _cli(capsys, *TRAIN, "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--max-steps", "1",
                     "--output-dir", str(tmp_path / "new"), "--resume-from-checkpoint", str(run))
    assert code == 2 and _error_line(err) == f"dynabatch train: error: --resume-from-checkpoint {run}: {said}"


def test_crash_before_manifest_falls_back(tmp_path):
    _save(tmp_path, 10)
    os.makedirs(step_dir(tmp_path, 20))
    _file_writer(0)(step_dir(tmp_path, 20), {"model/w0": torch.zeros(2)})  # rank 1 never wrote, no manifest
    with pytest.warns(EveryRankWarning, match="incomplete"):  # every rank finds it: rank 0 alone says so
        info = latest_checkpoint(str(tmp_path))
    assert info.step == 10
    with pytest.raises(CheckpointError, match="incomplete"):
        latest_checkpoint(str(tmp_path), fallback=False)


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 10, value=5.0)

    class Boom(Exception):
        pass

    def exploding(f):
        f.write(b"partial bytes")
        raise Boom

    with pytest.raises(Boom):  # the manifest's own write is atomic: the old one stays
        atomic_write(os.path.join(step_dir(tmp_path, 10), MANIFEST), exploding)
    assert not [n for n in os.listdir(step_dir(tmp_path, 10)) if n.startswith(".tmp-")]
    assert verify(step_dir(tmp_path, 10)).step == 10

    def crash(folder, state):
        _file_writer(0)(folder, state)
        raise Boom

    with pytest.raises(Boom):  # a save that dies after its data files: no manifest, so it does not count
        save_collective(str(tmp_path), 20, 0, {"model/w": torch.ones(1)}, gather=_one_rank, write=crash,
                        manifest_extra={}, run_id="run-a", keep=2)
    with pytest.warns(UserWarning, match="incomplete"):
        assert latest_checkpoint(str(tmp_path)).step == 10


def test_truncated_file_detected(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    shard = os.path.join(step_dir(tmp_path, 20), "shard-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="shard-00002.safetensors is corrupt or truncated"):
        verify(step_dir(tmp_path, 20))
    with pytest.warns(UserWarning):
        assert latest_checkpoint(str(tmp_path)).step == 10
    # named on purpose (--resume-from-checkpoint PATH, export PATH): no fallback, but the line says what to pass
    with pytest.raises(CheckpointError, match=r"truncated .*; pass another checkpoint \(.* also holds step-000010\), "
                                              r"or .* for its newest complete one$"):
        resolve_checkpoint(step_dir(tmp_path, 20))


def test_unlisted_data_file_and_older_format_are_refused(tmp_path):
    _save(tmp_path, 10)
    folder = step_dir(tmp_path, 10)
    save_file({"model/w0": torch.ones(3)}, os.path.join(folder, "extra.safetensors"))  # the reader would read it
    with pytest.raises(CheckpointError, match="holds data file extra.safetensors that its manifest does not list"):
        verify(folder)
    os.remove(os.path.join(folder, "extra.safetensors"))
    os.remove(os.path.join(folder, "shard-00002.safetensors"))
    with pytest.raises(CheckpointError, match="shard shard-00002.safetensors is missing"):
        verify(folder)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"format_version": 1, "step": 10, "shards": []}, f)
    with pytest.raises(CheckpointError) as e:
        verify(folder)
    assert "format version 1 (per-rank .pt shards" in str(e.value) and "reads format 2" in str(e.value)
    assert "\n" not in str(e.value)


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 3):
        _save(tmp_path, s)
    prune(str(tmp_path), keep=1, run_id="run-a")
    assert sorted(os.listdir(tmp_path)) == ["step-000003"]


def test_save_collective_through_dcp_records_run_id_and_finiteness(tmp_path):
    run_id = new_run_id()
    assert len(run_id) == 16 and int(run_id, 16) >= 0 and new_run_id() != run_id
    folder = save_collective(str(tmp_path), 4, 0, {"model/w": torch.ones(2), "optim/step/w": torch.tensor(3.0)},
                             gather=_one_rank, write=dcp_writer(None), manifest_extra={"data": None}, run_id=run_id,
                             keep=2)
    info = verify(folder)
    assert info.run_id == run_id and info.manifest["finite"] is True and info.step == 4
    mask = os.umask(0)
    os.umask(mask)  # every file of the checkpoint readable as the shards are (mkstemp alone gives 0600)
    modes = {name: os.stat(os.path.join(folder, name)).st_mode & 0o777 for name in os.listdir(folder)}
    assert set(modes.values()) == {0o666 & ~mask}, modes
    assert [s["file"] for s in info.manifest["shards"]] == data_files(folder) != []
    assert folder_run_id(folder) == run_id
    assert torch.equal(model_weights(folder)["w"], torch.ones(2))


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
        save_collective(str(tmp_path), step, 0, {"model/w": torch.zeros(1)}, gather=_one_rank, write=_file_writer(0),
                        manifest_extra={}, run_id="new", keep=2)
    assert _steps(tmp_path) == [4, 6, 8, 10, 12, 14]
    assert [folder_run_id(step_dir(tmp_path, s)) for s in (4, 6, 8, 10, 12, 14)] == ["new", "new", "old", "old", None, None]
    with pytest.raises(ValueError, match="needs the id of the run"):
        prune(str(tmp_path), 1, None)


def test_a_run_resumed_from_an_earlier_checkpoint_drops_its_later_ones_on_saving(tmp_path):
    """Run "r" saved 2, 4, 6, then resumed from 2 and saves 4 and 5 (keep 3): its step 6, of the steps it trained
    again, goes at the first save past the resume point (else it would stay the newest by step, kept over the run's
    own and resumed or exported as ``latest``); another run's later checkpoint stays."""
    for s in (2, 4, 6):
        _save(tmp_path, s, run_id="r")
    _save(tmp_path, 9, run_id="other")
    for step in (4, 5):
        save_collective(str(tmp_path), step, 0, {"model/w": torch.zeros(1)}, gather=_one_rank, write=_file_writer(0),
                        manifest_extra={}, run_id="r", keep=3)
    assert _steps(tmp_path) == [2, 4, 5, 9]
    assert latest_checkpoint(str(tmp_path)).run_id == "other"  # by step, as before: another run's is not ours to drop
    assert prune(str(tmp_path), keep=3, run_id="r", step=4) == [str(step_dir(tmp_path, 5))]


def test_prune_never_deletes_the_newest_finite_checkpoint(tmp_path):
    _save(tmp_path, 2, run_id="r")
    _save(tmp_path, 4, run_id="r", finite=False)  # as no save writes them: written by hand
    _save(tmp_path, 6, run_id="r", finite=False)
    prune(str(tmp_path), keep=1, run_id="r")
    assert _steps(tmp_path) == [2, 6]


def test_a_save_over_an_unfinished_one_drops_its_files(tmp_path):
    folder = step_dir(tmp_path, 4)  # a crashed save of a larger world left three files and no manifest
    os.makedirs(folder)
    for r in range(3):
        _file_writer(r)(folder, {f"model/w{r}": torch.zeros(1)})
    save_collective(str(tmp_path), 4, 0, {"model/v": torch.ones(1)}, gather=_one_rank, write=_file_writer(0),
                    manifest_extra={}, run_id="r", keep=2)
    assert data_files(folder) == ["shard-00001.safetensors"] and sorted(model_weights(folder)) == ["v"]


def test_first_non_finite_names_the_tensor():
    state = {"stage": {"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}, "rng": torch.zeros(3, dtype=torch.uint8),
             "optimizer": {"state": {0: {"exp_avg": torch.ones(1)}}}, "step": 3}
    assert first_non_finite(state) == "stage.b"
    state["stage"]["b"] = torch.ones(2)
    assert first_non_finite(state) is None
    state["optimizer"]["state"][0]["exp_avg"] = torch.tensor([float("nan")])
    assert first_non_finite(state) == "optimizer.state.0.exp_avg"


def _threaded_save(root, step, states, fail_rank: int | None = None):
    """Run save_collective on len(states) ranks as threads that gather through a barrier (like
    all_gather_object), rank ``fail_rank`` finding the disk full; returns each rank's result or exception."""
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
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if rank == fail_rank else None
        try:
            results[rank] = save_collective(str(root), step, rank, states[rank], gather=gather_for(rank),
                                            write=_file_writer(rank, full), manifest_extra={},
                                            run_id="r" if rank == 0 else None, keep=2)
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
    states = [{"model/w": torch.ones(2)}, {"model/w": torch.tensor([0.0, float("nan")])}]
    results = _threaded_save(tmp_path, 4, states)
    for e in results:  # every rank raises the same line
        assert isinstance(e, NonFiniteError) and isinstance(e, ValueError), e
        assert str(e) == str(results[0])
    msg = str(results[0])
    assert "step 4" in msg and "rank 1 'model/w'" in msg and "rank 0" not in msg and "Lower --learning-rate" in msg
    assert _steps(tmp_path) == [2] and verify(step_dir(tmp_path, 2)).step == 2


def test_disk_full_on_one_rank_leaves_no_partial_folder(tmp_path):
    _save(tmp_path, 2, run_id="r")
    results = _threaded_save(tmp_path, 4, [{"model/w": torch.ones(1)}, {"model/v": torch.ones(1)}], fail_rank=1)
    for e in results:
        assert isinstance(e, CheckpointWriteError) and isinstance(e, ValueError), e
    msg = str(results[0])
    assert step_dir(tmp_path, 4) in msg and "rank 1: No space left on device (ENOSPC)" in msg
    assert "free disk space" in msg and "--resume-from-checkpoint" in msg and "--output-dir" in msg
    assert _steps(tmp_path) == [2] and verify(step_dir(tmp_path, 2)).step == 2


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_through_dcp_keeps_a_folder_this_save_did_not_create(tmp_path, monkeypatch):
    import safetensors.torch

    os.makedirs(step_dir(tmp_path, 4))
    (tmp_path / "step-000004" / RUN_ID_FILE).write_text("r")  # this run's folder (an earlier unfinished save)
    (tmp_path / "step-000004" / "notes.txt").write_text("not ours")
    monkeypatch.setattr(safetensors.torch, "save", _disk_full)  # what DCP's safetensors writer calls
    with pytest.raises(CheckpointWriteError, match="rank 0: No space left on device"):
        save_collective(str(tmp_path), 4, 0, {"model/w": torch.ones(1)}, gather=_one_rank, write=dcp_writer(None),
                        manifest_extra={}, run_id="r", keep=1)
    assert sorted(os.listdir(step_dir(tmp_path, 4))) == ["notes.txt", RUN_ID_FILE]


def test_read_only_checkpoint_folder(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders (the ENOSPC tests cover the same path)")
    _save(tmp_path, 2, run_id="r")
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(CheckpointWriteError, match=r"Permission denied \(EACCES\).*free disk space"):
            save_collective(str(tmp_path), 4, 0, {"model/w": torch.ones(1)}, gather=_one_rank,
                            write=dcp_writer(None), manifest_extra={}, run_id="r", keep=1)
    finally:
        os.chmod(tmp_path, 0o755)
    assert _steps(tmp_path) == [2]


# --- global names across layouts ----------------------------------------------------------------------


def _stages(model, num_stages: int):
    from dynabatch.models.split import build_stages, layout_for

    stages = build_stages(model, layout_for(model, num_stages))
    return stages, [torch.optim.AdamW(s.parameters(), lr=1e-2) for s in stages]


def test_a_one_stage_checkpoint_loads_into_two_stages_with_tied_weights_and_moments(tmp_path):
    from dynabatch.models.presets import build_model

    model = build_model("t5-tiny", vocab_size=384, seed=3)
    (one,), (opt,) = _stages(model, 1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # two real AdamW steps: moments and step counts that are not the initial ones
        for p in one.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    folder = save_collective(str(tmp_path), 2, 0, stage_state(one, opt, 0), gather=_one_rank, write=dcp_writer(None),
                             manifest_extra={}, run_id="r", keep=1)
    saved = {one.parameter_map[n]: (p, opt.state[p]) for n, p in one.named_parameters()}
    stages, opts = _stages(model, 2)  # fresh weights of the seed, empty optimizers
    holders: dict[str, int] = {}
    for stage, o in zip(stages, opts):
        load_stage_state(folder, stage, o, rank=None)
        for local, p in stage.named_parameters():
            name = stage.parameter_map[local]
            holders[name] = holders.get(name, 0) + 1
            weight, state = saved[name]
            assert torch.equal(p, weight), name
            assert sorted(o.state[p]) == ["exp_avg", "exp_avg_sq", "step"] and float(o.state[p]["step"]) == 2.0
            assert torch.equal(o.state[p]["exp_avg_sq"], state["exp_avg_sq"]) and o.state[p]["step"].dim() == 0
    assert holders["shared.weight"] == 2  # the tied embedding: on the encoder's first and the decoder's stage
    assert set(holders) == set(saved)


# --- export -------------------------------------------------------------------------------------------


def _model_checkpoint(root, step: int, poison: str | None = None, tokenizer: str = "byt5"):
    """A one-stage t5-tiny checkpoint with ``poison`` (a stage parameter name) holding a NaN, written
    without the save's finiteness check (as by hand). Returns (folder, stage)."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.data.tokenize import load_tokenizer, tokenizer_info
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import build_stage, layout_for

    cfg = TrainConfig(model="t5-tiny", tokenizer=tokenizer, output_dir=str(root))
    model = build_model(cfg.model, vocab_size=tokenizer_info(load_tokenizer(cfg.tokenizer)).vocab_size, seed=1)
    stage = build_stage(model, layout_for(model, 1), 0)
    state = stage_state(stage, torch.optim.AdamW(stage.parameters()), 0)
    if poison:
        state["model/" + stage.parameter_map[poison]].view(-1)[0] = float("nan")
    folder = step_dir(str(root), step)
    os.makedirs(folder)
    dcp_writer(None)(folder, state)
    write_manifest(str(root), step, [file_entry(folder, n) for n in data_files(folder)],
                   {"config": cfg.to_dict(), "run_id": "r"})
    return folder, stage


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
         "--max-target-len", "32", "--logging-steps", "0", "--no-timeline", "--task-loss-every", "0"]


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("dynabatch train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_train_keeps_one_run_id_across_resume_and_refuses_a_path_that_is_no_checkpoint(tmp_path, capsys,
                                                                                       toy_mixture_dir):
    out = tmp_path / "run"
    common = [*TRAIN, "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir", str(out),
              "--save-steps", "1", "--save-total-limit", "1"]
    assert _cli(capsys, *common, "--max-steps", "2")[0] == 0
    root = out / "checkpoints"
    assert _steps(root) == [2]
    first = verify(step_dir(root, 2))
    assert first.manifest["finite"] is True and len(first.run_id) == 16
    assert first.manifest["world"] == {"stages": 1, "replicas": 1} and first.manifest["scheduler"]["last_epoch"] == 2
    assert first.manifest["calibration"]["key"]["layout"] and first.manifest["calibration"]["fit"]
    _save(root, 1, run_id="another-run")  # not this run's: pruning must leave it
    code, err = _cli(capsys, *common, "--max-steps", "3", "--resume-from-checkpoint")  # no value: latest
    assert code == 0, err[-2000:]
    assert _steps(root) == [1, 3] and verify(step_dir(root, 3)).run_id == first.run_id
    assert resolve_checkpoint(str(root)).step == 3 and resolve_checkpoint(step_dir(root, 3)).step == 3

    other = [*TRAIN, "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir", str(tmp_path / "new"),
             "--max-steps", "4", "--resume-from-checkpoint"]
    code, err = _cli(capsys, *other, str(toy_mixture_dir))
    line = _error_line(err)
    assert code == 2 and f"--resume-from-checkpoint {toy_mixture_dir}: {str(toy_mixture_dir)!r} is not a checkpoint: " in line
    assert "pass a step-NNNNNN folder (with manifest.json) or a run's checkpoints/ folder" in line
    shard = os.path.join(step_dir(root, 3), data_files(step_dir(root, 3))[0])
    with open(shard, "r+b") as f:
        f.truncate(100)
    code, err = _cli(capsys, *other, step_dir(root, 3))
    assert code == 2 and f"{data_files(step_dir(root, 3))[0]} is corrupt or truncated" in _error_line(err)
    os.remove(os.path.join(step_dir(root, 1), MANIFEST))
    code, err = _cli(capsys, *other, str(root))  # every checkpoint in it broken
    assert code == 2 and "holds no complete checkpoint" in _error_line(err)
    assert not (tmp_path / "new" / "checkpoints").exists() or _steps(tmp_path / "new" / "checkpoints") == []


def test_disk_full_during_train_is_one_line_and_exit_2(tmp_path, capsys, toy_mixture_dir, monkeypatch):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save", _disk_full)
    code, err = _cli(capsys, *TRAIN, "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
                     "--output-dir", str(tmp_path / "run"), "--max-steps", "1")
    line = _error_line(err)
    assert code == 2
    assert f"could not write checkpoint {step_dir(tmp_path / 'run' / 'checkpoints', 1)}" in line
    assert "No space left on device (ENOSPC)" in line and "free disk space" in line
    assert _steps(tmp_path / "run" / "checkpoints") == []


@pytest.mark.parametrize("theirs", ["other-run", "user-files"])
def test_a_save_never_claims_a_step_folder_of_another_run_or_of_the_user(tmp_path, theirs):
    """A run resumed into a folder holding another run's checkpoints at the steps it saves (or a step-NNNNNN folder
    of the user's) used to delete their data files and claim the folder (which pruning later deleted whole): the
    save is refused in one line, and that folder is left byte for byte."""
    folder = step_dir(tmp_path, 4)
    if theirs == "other-run":
        _save(tmp_path, 4, run_id="other")
    else:
        os.makedirs(folder)
        with open(os.path.join(folder, "notes.txt"), "w") as f:
            f.write("mine")
        _file_writer(0)(folder, {"mine": torch.ones(2)})
    before = {n: open(os.path.join(folder, n), "rb").read() for n in os.listdir(folder)}
    with pytest.raises(CheckpointWriteError, match="not writing checkpoint .*step-000004: it already holds"):
        save_collective(str(tmp_path), 4, 0, {"model/v": torch.ones(1)}, gather=_one_rank, write=_file_writer(0),
                        manifest_extra={}, run_id="r", keep=1)
    assert {n: open(os.path.join(folder, n), "rb").read() for n in os.listdir(folder)} == before


def test_a_re_export_that_does_not_load_names_the_files_it_did_not_write(tmp_path, capsys):
    """Re-exporting into an earlier export's folder keeps files the new export does not write (a model card, a
    tokenizer file of the earlier one): one that breaks AutoTokenizer's load was a bare `Expecting value: line 1
    column 1` and left the earlier export's record, naming another checkpoint, beside the new weights."""
    _model_checkpoint(tmp_path / "ckpt", 2, tokenizer="builtin")  # a fast tokenizer: it writes no special_tokens_map
    out = tmp_path / "hf"
    assert _cli(capsys, "export", str(tmp_path / "ckpt"), str(out))[0] == 0
    (out / "README.md").write_text("card")
    (out / "special_tokens_map.json").write_text("{bad")
    code, err = _cli(capsys, "export", str(tmp_path / "ckpt"), str(out))
    lines = [line for line in err.splitlines() if line.startswith("dynabatch export: error:")]
    assert code == 2 and len(lines) == 1, err
    assert "does not load with AutoTokenizer.from_pretrained" in lines[0]
    assert "did not write (README.md, special_tokens_map.json): export into a new or empty folder" in lines[0]
    assert (out / "README.md").read_text() == "card" and not (out / "dynabatch_export.json").exists()


def test_resume_latest_where_every_finished_save_is_corrupt_is_one_line_not_a_fresh_start(tmp_path):
    """``--resume-from-checkpoint`` (latest) with every checkpoint corrupt started from step 0 with a warning, a new
    run id, and wrote over those folders at its saves: it is an error naming them. A folder with no finished save (a
    crash in the first save) still starts from step 0."""
    from types import SimpleNamespace

    from dynabatch.training.config import TrainConfig
    from dynabatch.training.resume import find_resume_checkpoint

    root = tmp_path / "checkpoints"
    cfg = TrainConfig(model="t5-tiny", output_dir=str(tmp_path), resume_from_checkpoint="latest")
    ctx = SimpleNamespace(is_planner=True)
    os.makedirs(step_dir(root, 2))  # the first save crashed: nothing finished, start over
    with pytest.warns(UserWarning):
        assert find_resume_checkpoint(cfg, ctx) is None
    _save(root, 4)
    with open(os.path.join(step_dir(root, 4), "shard-00001.safetensors"), "r+b") as f:
        f.truncate(10)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"every checkpoint in .*checkpoints is corrupt "
                                                                     r"\(step-000004: see the warnings above\)"):
        find_resume_checkpoint(cfg, ctx)
