"""Every result file under ``docs/benchmarks/<name>/`` is cited by that folder's page, and every result file a page
cites exists.

- Each file in a benchmark folder other than its ``.md`` page(s) is named by a page in the same folder: by its
  exact file name anywhere in the page's text (bare, or as ``docs/benchmarks/<name>/<file>``), or by a glob written
  in backticks in the page that matches it (``*``, ``?``, ``[...]`` as in ``fnmatch``, and shell braces
  ``{a,b}``), e.g. `` `flatrows_t5_1024_builtin_2026-12-03_run*.json` ``. A name under another folder
  (``../row_layouts/flat_rows_2026-12-03.json``) cites that folder's file, not this one's.
- Each word in backticks (inline code, outside fenced blocks) with a result-like extension (``.json``, ``.jsonl``,
  ``.npz``, ``.png``, ``.csv``, ``.log``, ``.txt``) that names a benchmark file, i.e. a bare file name,
  ``../<folder>/<file>`` or ``docs/benchmarks/...``, exists; a glob matches at least one file, and so does each
  word its braces expand to. Words with another directory (``data/heavy_tail_L.npz``, ``RUN_DIR/metrics.jsonl``)
  are command arguments or run outputs and are not checked here. README.md and every docs page are held to the
  same rule for words that point into ``docs/benchmarks/``.

Pure text processing over a few dozen small pages: well under a second.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(ROOT, "docs", "benchmarks")
RESULT_EXT = (".json", ".jsonl", ".npz", ".png", ".csv", ".log", ".txt")
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.M | re.S)
CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # a code span: N backticks .. N backticks


def _folders() -> list[str]:
    return sorted(d for d in glob.glob(os.path.join(BENCH, "*")) if os.path.isdir(d))


def _pages(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.md")))


def _results(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder)
                  if os.path.isfile(os.path.join(folder, f)) and not f.endswith(".md"))


def expand_braces(pattern: str) -> list[str]:
    """Shell brace expansion, ``a_{x,y}_b`` -> ``a_x_b``, ``a_y_b`` (nested and repeated groups too)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if not m:
        return [pattern]
    out = []
    for alt in m.group(1).split(","):
        out.extend(expand_braces(pattern[:m.start()] + alt + pattern[m.end():]))
    return out


def cited_words(text: str) -> list[str]:
    """Words in inline code spans (fenced blocks left out) that end in a result-like extension, stripped of the
    punctuation around them and of an ``--option=`` prefix."""
    words = []
    for _, span in CODE.findall(FENCE.sub("", text)):
        for word in span.split():
            word = word.split("=", 1)[-1].strip("()[],;:'\"")
            if word.endswith(RESULT_EXT):
                words.append(word)
    return words


def is_glob(word: str) -> bool:
    return any(c in word for c in "*?[{")


def _page_globs(text: str) -> list[str]:
    """The bare-name globs a page writes in backticks (a name with a folder is another folder's citation)."""
    return [p for w in cited_words(text) if is_glob(w) and "/" not in w for p in expand_braces(w)]


def names_exactly(text: str, folder: str, name: str) -> bool:
    """Whether ``text`` names the file ``name`` of benchmark folder ``folder``: the name as a whole word, bare or
    after ``benchmarks/<folder>/`` (after another folder's path it is that folder's file)."""
    for m in re.finditer(re.escape(name), text):
        before, after = text[:m.start()], text[m.end():m.end() + 1]
        if after and (after.isalnum() or after in "_-"):
            continue
        if not before or not (before[-1].isalnum() or before[-1] in "_-./"):
            return True
        if before.endswith(f"benchmarks/{os.path.basename(folder)}/"):
            return True
    return False


def uncited(folder: str) -> list[str]:
    """Files of ``folder`` no page of the folder names exactly or by a backticked glob."""
    texts = [open(p, encoding="utf-8").read() for p in _pages(folder)]
    globs = [g for t in texts for g in _page_globs(t)]
    return [f for f in _results(folder)
            if not any(names_exactly(t, folder, f) for t in texts)
            and not any(fnmatch.fnmatchcase(f, g) for g in globs)]


def missing(page: str) -> list[str]:
    """Result files ``page`` cites in backticks that do not exist. A glob must match a file, and so must each
    word its braces expand to (``run{1,2,3}`` names three runs)."""
    here = os.path.dirname(page)
    in_bench = os.path.dirname(here) == BENCH
    out = []
    for word in cited_words(open(page, encoding="utf-8").read()):
        if word.startswith("docs/benchmarks/"):
            base = os.path.dirname(os.path.dirname(BENCH))  # the repository root
        elif in_bench and ("/" not in word or re.match(r"^\.\./[^/]+/[^/]+$", word)):
            base = here
        elif "benchmarks/" in word and not word.startswith(("/", "http")):
            base = here
        else:
            continue
        if not all(glob.glob(os.path.join(base, p)) for p in expand_braces(word)):
            out.append(word)
    return out


FOLDERS = _folders()
PAGES = sorted([os.path.join(ROOT, "README.md")]
               + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def test_benchmark_folders_are_found():
    assert len(FOLDERS) > 10 and all(_pages(f) for f in FOLDERS), "every benchmark folder holds a page"


@pytest.mark.parametrize("folder", FOLDERS, ids=_rel)
def test_every_result_file_is_cited_by_its_page(folder):
    left = uncited(folder)
    assert not left, (f"{_rel(folder)}: files no page in the folder cites (name them, or a backticked glob, in "
                      f"the page's Files list, or remove them): {left}")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_cited_result_file_exists(page):
    gone = missing(page)
    assert not gone, f"{_rel(page)} cites result files that do not exist: {gone}"


def test_the_rules_catch_an_uncited_file_and_a_missing_citation(tmp_path, monkeypatch):
    folder = tmp_path / "docs" / "benchmarks" / "demo"
    folder.mkdir(parents=True)
    (folder / "demo_2cpu_202612.md").write_text(
        "Runs `t5_1024_{builtin,heavy}_2026-12-03.json` and `flatrows_run*.json`; the plot plot.png.\n"
        "Also `gone_2026-12-03.json`, `../other/x.json`, `t5_1024_{heavy,tail}_2026-12-03.json` and, as an "
        "argument, `data/heavy_tail_L.npz`. Another folder's `../other/moved_2026-12-03.json`; "
        "`docs/benchmarks/demo/profile_2026-12-03.json`; old_stray_2026-12-03.json.bak\n"
        "```\ndynabatch bench --out not_checked_in_a_fence.json\n```\n")
    for name in ("t5_1024_builtin_2026-12-03.json", "t5_1024_heavy_2026-12-03.json", "flatrows_run1.json",
                 "plot.png", "stray_2026-12-03.json", "moved_2026-12-03.json", "profile_2026-12-03.json"):
        (folder / name).write_text("{}")
    monkeypatch.setattr(sys.modules[__name__], "BENCH", str(tmp_path / "docs" / "benchmarks"))
    assert uncited(str(folder)) == ["moved_2026-12-03.json", "stray_2026-12-03.json"]
    assert missing(str(folder / "demo_2cpu_202612.md")) == [
        "gone_2026-12-03.json", "../other/x.json", "t5_1024_{heavy,tail}_2026-12-03.json",
        "../other/moved_2026-12-03.json"]


def test_brace_expansion():
    assert expand_braces("{t5,gpt}_2048_{builtin,heavy}.json") == [
        "t5_2048_builtin.json", "t5_2048_heavy.json", "gpt_2048_builtin.json", "gpt_2048_heavy.json"]
    assert expand_braces("run{1,2,3}.json") == ["run1.json", "run2.json", "run3.json"]
    assert expand_braces("plain.json") == ["plain.json"]
