"""The documentation a newcomer follows stays true: links resolve and the commands shown parse.

- Every relative link in ``README.md`` and ``docs/**/*.md`` (``[text](path)`` and ``![alt](path)``, anchors cut
  off) names a file or folder that exists.
- Every ``dynabatch ...`` command in their fenced code blocks (also ``python -m dynabatch ...`` and
  ``torchrun ... -m dynabatch ...``) parses its options against the command's real argparse parser
  (``dynabatch.cli.command_parser``), without running the job.
- ``docs/cli_reference.md`` equals what ``scripts/gen_cli_reference.py`` generates now.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PAGES = sorted([os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def relative_links(page: str) -> list[str]:
    """The relative link targets of ``page`` outside code blocks (URLs and pure anchors left out)."""
    text = FENCE.sub("", open(page, encoding="utf-8").read())
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def shown_commands(page: str) -> list[str]:
    """Each ``dynabatch`` command line in ``page``'s fenced code blocks: continuations joined, comments cut.
    Blocks marked ```` ```text ```` hold synopses and output, not commands, and are left out."""
    commands = []
    for info, block in FENCE.findall(open(page, encoding="utf-8").read()):
        if info.strip() == "text":
            continue
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"^\s*\$\s+", "", line)
            m = re.search(r"(?:^|\s|-m\s+)(dynabatch\s+[a-z][a-z-]*\b.*)$", line)
            if not m or line.lstrip().startswith(("#", ">>>", "from ", "import ")):
                continue
            if not re.match(r"^\s*(dynabatch|python -m dynabatch|torchrun\b)", line):
                continue
            commands.append(" ".join(re.sub(r"\s+#.*$", "", m.group(1)).split()))
    return commands


def _cases():
    for page in PAGES:
        for command in shown_commands(page):
            yield pytest.param(command, id=f"{_rel(page)}: {command[:60]}")


def test_every_page_is_found():
    names = {_rel(p) for p in PAGES}
    assert "README.md" in names and "docs/cli_reference.md" in names and len(names) > 10


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page)
               if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), t)))]
    assert not missing, f"{_rel(page)} links to missing files: {missing}"


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[ok](p.md) [gone](nowhere.md#x) `[not a link](x)` [web](https://x.y) [anchor](#a)\n"
                    "```\n[in code](y.md)\n```\n")
    assert relative_links(str(page)) == ["p.md", "nowhere.md"]


def test_commands_are_found_in_code_blocks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("`dynabatch train --inline` is prose\n```bash\ndynabatch train --stages 2 \\\n    --max-steps 3"
                    "   # comment\ntorchrun --nproc-per-node 2 -m dynabatch train --stages 2\n# dynabatch plan\n```\n"
                    "```text\ndynabatch plan [--lengths FILE]\n```\n")
    assert shown_commands(str(page)) == ["dynabatch train --stages 2 --max-steps 3", "dynabatch train --stages 2"]


@pytest.mark.parametrize("command", list(_cases()))
def test_every_shown_command_parses(command):
    from dynabatch.cli import COMMANDS, command_parser

    argv = shlex.split(command)[1:]
    assert argv and argv[0] in COMMANDS, f"unknown command in {command!r}"
    _, parser = command_parser(argv[0])
    parser.parse_args(argv[1:])  # raises FlagError (a ValueError) on an unknown flag or a bad value


def test_a_wrong_flag_fails_to_parse():
    from dynabatch.cli import FlagError, command_parser

    _, parser = command_parser("train")
    with pytest.raises(FlagError):
        parser.parse_args(["--stages", "2", "--no-such-flag"])


def test_the_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", os.path.join(ROOT, "scripts", "gen_cli_reference.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with open(os.path.join(ROOT, "docs", "cli_reference.md"), encoding="utf-8") as f:
        assert f.read() == gen.render(), "run python scripts/gen_cli_reference.py"
