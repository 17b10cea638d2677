"""The repository speaks of itself only, and tracks nothing built or downloaded.

Every tracked text file is scanned for mentions of the work sessions that produced it ("the twenty-second
session", "session21", "sessions 13-15"): results are named by what they measure and when, never by who ran
them. A tracked wheel (a downloaded build artefact) fails too.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|"
             r"(?:twenty|thirty)-\w+|\d+(?:st|nd|rd|th)")
SESSION_PATTERNS = [
    re.compile(r"sessions?[ _-]?\d", re.IGNORECASE),                       # session 22, session21, sessions 13
    re.compile(rf"\b(?:{_ORDINALS})[ -]+(?:\w+[ -]+)?sessions?\b", re.IGNORECASE),  # the twenty-first (GPU) session
    re.compile(r"\b(?:this|that|next|previous|earlier|later|last|each|every|helper|gpu|device)[ -]+sessions?\b",
               re.IGNORECASE),                                           # this session, the GPU session
]


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def session_mentions(text: str) -> list[str]:
    """Each line of ``text`` that names a work session."""
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in SESSION_PATTERNS)]


@pytest.mark.parametrize("line", [
    "the twenty-second session measured it", "Twenty-fifth session: ...", "docs/results/flat_session15.json",
    "gpu_h200_session21/kernels.txt", "in sessions 13 and 14", "(first GPU session)", "this session's runs",
    "the 3rd session", "session 9",
])
def test_the_patterns_catch_every_way_a_session_is_named(line):
    assert session_mentions(line) == [line]


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="session")', "a training session on one GPU", "requests.Session()",
    "an interactive session",
])
def test_the_patterns_leave_generic_uses_alone(line):
    assert session_mentions(line) == []


def test_no_tracked_file_names_a_work_session():
    offenders = []
    for path in _tracked_files():
        if path == "tests/unit/test_repo_hygiene.py":  # its own examples above
            continue
        if session_mentions(path):
            offenders.append(f"{path}: (file name)")
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            continue
        with open(full, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue  # binary
        for line in session_mentions(data.decode("utf-8", errors="replace")):
            offenders.append(f"{path}: {line[:120]}")
    assert not offenders, "name results by what they measure and a date:\n" + "\n".join(offenders[:50])


def test_no_wheel_or_build_output_is_tracked():
    built = [p for p in _tracked_files() if p.endswith((".whl", ".pyc", ".egg-info")) or "/__pycache__/" in p]
    assert not built, built
