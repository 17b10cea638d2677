"""The repository speaks of itself only, and tracks nothing built or downloaded.

Every tracked text file, this one included, is scanned for mentions of the work periods that produced it (an
ordinal or a number next to the word, :data:`WORD`): results are named by what they measure and when, never by who
ran them. The examples below are spelled through :data:`WORD` so that this file passes its own scan. A tracked wheel
(a downloaded build artefact) fails too.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

WORD = "ses" "sion"
"""The word the scan looks for, split so that this file does not name one itself."""

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|"
             r"(?:twenty|thirty)-\w+|\d+(?:st|nd|rd|th)")
MENTION_PATTERNS = [
    re.compile(rf"{WORD}s?[ _-]?\d", re.IGNORECASE),  # the word, then a number
    re.compile(rf"\b(?:{_ORDINALS})[ -]+(?:\w+[ -]+)?{WORD}s?\b", re.IGNORECASE),  # an ordinal (and a word), then it
    re.compile(rf"\b(?:this|that|next|previous|earlier|later|last|each|every|helper|gpu|device)[ -]+{WORD}s?\b",
               re.IGNORECASE),  # a demonstrative or a kind, then it
]


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def period_mentions(text: str) -> list[str]:
    """Each line of ``text`` that names a work period (:data:`MENTION_PATTERNS`)."""
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in MENTION_PATTERNS)]


@pytest.mark.parametrize("line", [f.format(w=WORD) for f in [
    "the twenty-second {w} measured it", "Twenty-fifth {w}: ...", "docs/results/flat_{w}15.json",
    "gpu_h200_{w}21/kernels.txt", "in {w}s 13 and 14", "(first GPU {w})", "this {w}'s runs",
    "the 3rd {w}", "{w} 9",
]])
def test_the_patterns_catch_every_way_a_work_period_is_named(line):
    assert period_mentions(line) == [line]


@pytest.mark.parametrize("line", [f.format(w=WORD) for f in [
    '@pytest.fixture(scope="{w}")', "a training {w} on one GPU", "requests.Session()", "an interactive {w}",
]])
def test_the_patterns_leave_generic_uses_alone(line):
    assert period_mentions(line) == []


def test_no_tracked_file_names_a_work_period():
    offenders = []
    for path in _tracked_files():
        if period_mentions(path):
            offenders.append(f"{path}: (file name)")
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            continue
        with open(full, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue  # binary
        for line in period_mentions(data.decode("utf-8", errors="replace")):
            offenders.append(f"{path}: {line[:120]}")
    assert not offenders, "name results by what they measure and a date:\n" + "\n".join(offenders[:50])


def test_no_wheel_or_build_output_is_tracked():
    built = [p for p in _tracked_files() if p.endswith((".whl", ".pyc", ".egg-info")) or "/__pycache__/" in p]
    assert not built, built
