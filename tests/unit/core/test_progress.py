"""Progress output: a tqdm bar on a terminal, plain periodic lines (no carriage returns) in a file."""

from __future__ import annotations

import io
import logging

import pytest

from dynabatch.core.progress import PlainProgress, progress, progress_mode


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_and_a_file_gets_plain_lines(monkeypatch):
    monkeypatch.delenv("DYNABATCH_PROGRESS", raising=False)
    assert progress_mode(_Tty()) == "bar"
    assert progress_mode(io.StringIO()) == "plain"
    from tqdm import tqdm

    bar = progress(total=3, stream=_Tty(), file=_Tty())
    assert isinstance(bar, tqdm)
    bar.close()
    assert isinstance(progress(total=3, stream=io.StringIO()), PlainProgress)


def test_the_environment_overrides_and_rejects_unknown_modes(monkeypatch):
    monkeypatch.setenv("DYNABATCH_PROGRESS", "plain")
    assert progress_mode(_Tty()) == "plain"
    monkeypatch.setenv("DYNABATCH_PROGRESS", "sometimes")
    with pytest.raises(ValueError, match="DYNABATCH_PROGRESS"):
        progress_mode(_Tty())


def test_plain_progress_writes_about_ten_lines_for_any_total(caplog):
    caplog.set_level(logging.INFO, logger="dynabatch.core.progress")
    for total in (30, 1000):
        caplog.clear()
        bar = PlainProgress(total=total, desc="train dynamic", unit="steps", every_s=1e9)
        for step in range(total):
            bar.set_postfix(loss=f"{10 - step / total:.3f}")
            bar.update(1)
        bar.close()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 10 == bar.lines
        assert lines[-1].startswith(f"train dynamic: {total}/{total} steps, loss=")
        assert not any("\r" in line for line in lines)


def test_plain_progress_iterates_writes_the_end_once_and_can_be_silenced(caplog):
    caplog.set_level(logging.INFO, logger="dynabatch.core.progress")
    assert list(PlainProgress(range(5), desc="check", unit="shape")) == [0, 1, 2, 3, 4]
    assert [r.getMessage().split(",")[0] for r in caplog.records][-1] == "check: 5/5 shape"
    caplog.clear()
    with PlainProgress(total=None, desc="profile", every_s=0.0) as bar:  # unknown total: by time only
        bar.set_postfix_str("t5_enc")
        bar.update(2)
    assert [r.getMessage().split(", ")[:2] for r in caplog.records] == [["profile: 2 it", "t5_enc"]]
    caplog.clear()
    silent = progress(range(3), disable=True)
    assert list(silent) == [0, 1, 2] and caplog.records == []
