"""The README and docs/ say only what the code does.

- ``docs/CONFIG.md`` is generated from the config schema and the parser
  (``cluster/cli/reference.py``): it must be what the code generates now.
- Every ``prefixserve …`` line of a shell block parses against the CLI
  (an unknown or renamed flag fails), and every ``--flag`` of an inline
  ``prefixserve <command> …`` span is a flag of that command.
- Every Python block runs, except those marked
  ``<!-- docs-test: needs a cluster -->`` (they call a running cluster).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.main import build_parser
from cluster.cli.reference import config_reference

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS_CLUSTER = "<!-- docs-test: needs a cluster -->"
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "2>&1"}


def code_blocks(path: Path) -> list[tuple[str, int, str, bool]]:
    """``(language, first line number, text, needs a cluster)`` of each fenced block."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        marked = any(NEEDS_CLUSTER in lines[j] for j in range(max(0, i - 2), i))
        start, i = i + 1, i + 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            i += 1
        blocks.append((fence.group(1), start + 1, "\n".join(lines[start:i]), marked))
        i += 1
    return blocks


def shell_commands(text: str) -> list[list[str]]:
    """The ``prefixserve`` invocations of a shell block, as argv (backslash
    continuations joined, comments and redirections dropped)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if "prefixserve" not in line.split("#", 1)[0]:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        tokens = list(lexer)
        segment: list[str] = []
        skip_next = False
        for token in tokens + [";"]:
            if skip_next:
                skip_next = False
                continue
            if token in SHELL_OPERATORS:
                if segment and Path(segment[0]).name == "prefixserve":
                    out.append(segment)
                segment, skip_next = [], token in (">", ">>", "<", "2>")
                continue
            if not segment and re.match(r"^[A-Z_]+=", token):
                continue  # an environment assignment before the command
            segment.append(token)
    return out


def _parse(argv: list[str]) -> str:
    """'' when ``argv`` parses, else argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            return err.getvalue().strip() or f"exit {exc.code}"
    return ""


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for language, line, text, _ in code_blocks(page):
            if language in ("bash", "sh", "shell", ""):
                found += [(f"{page.relative_to(ROOT)}:{line}", argv) for argv in shell_commands(text)]
    return found


def test_config_reference_matches_the_code():
    committed = (ROOT / "docs" / "CONFIG.md").read_text()
    assert committed == config_reference(), (
        "docs/CONFIG.md is out of date: run .venv/bin/python scripts/gen_reference.py and commit it")


def test_every_documented_command_line_parses():
    commands = documented_commands()
    assert len(commands) >= 40, commands  # the README and the guides show that many
    bad = [f"{where}: {' '.join(argv)}\n    {problem}" for where, argv in commands
           if (problem := _parse(argv[1:]))]
    assert not bad, "documented commands the CLI rejects:\n" + "\n".join(bad)


def _command_flags() -> dict[str, set[str]]:
    from cluster.cli.reference import _subparsers

    parser = build_parser()
    flags = {words: {opt for a in sub._actions for opt in a.option_strings}
             for words, (sub, _) in _subparsers(parser).items()}
    groups = {words.split()[0]: set() for words in flags if " " in words}  # `prefixserve bench` alone
    return {**groups, **flags}


def test_inline_commands_name_only_their_commands_flags():
    flags = _command_flags()
    checked, bad = 0, []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # inline spans outside blocks
        for span in re.findall(r"`((?:\.venv/bin/)?prefixserve [^`]+)`", text):
            words = span.split()[1:]
            command = next((" ".join(words[:n]) for n in (2, 1) if " ".join(words[:n]) in flags), None)
            if command is None:
                bad.append(f"{page.name}: `{span}` names no prefixserve command")
                continue
            checked += 1
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span):
                if flag not in flags[command] and flag != "--log-level":
                    bad.append(f"{page.name}: `{span}`: {flag} is not a flag of prefixserve {command}")
    assert checked >= 20, checked
    assert not bad, "\n".join(bad)


def _python_blocks() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(ROOT)}:{line}", text) for page in PAGES
            for language, line, text, marked in code_blocks(page) if language == "python" and not marked]


def test_the_cluster_blocks_are_marked_and_the_rest_run_here():
    runnable = _python_blocks()
    assert runnable, "no Python block runs without a cluster: the offline API example is one"
    for where, text in runnable:
        assert "OpenAI(" not in text and "client." not in text, f"{where} calls a cluster: mark it {NEEDS_CLUSTER}"


@pytest.mark.parametrize("where, text", _python_blocks(), ids=[w for w, _ in _python_blocks()])
def test_python_block_runs(where, text, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
