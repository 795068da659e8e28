"""README.md's commands run as written. Its ```bash blocks are read from the file; a block whose
last non-blank line before it is an HTML comment (invisible on GitHub) is run, in README order,
in a scratch folder that holds links to what the commands read (README.md, docs/, scripts/):

    <!-- test: quick -->   run by the quick selection (pytest -m "not slow")
    <!-- test: slow -->    run, after the quick blocks, only with -m slow

Unmarked blocks are not run, only checked, and so are the ```bash blocks of docs/*.md: every
`npmegatron ...` names real commands and options, every `python scripts/*.py` and `pytest` path
exists, every `mpiexec` is installed and every `pip install -e ".[extras]"` names extras setup.py
declares. Unmarked blocks hold what a test must not run: pip install and python -m venv (they
change the environment), pytest (the suite itself), the main job and the benchmarks (minutes
each); a marked block may hold none of them."""
import glob
import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import click
import pytest

from helpers import ROOT, rank_environment

README = os.path.join(ROOT, "README.md")
READ_BY_COMMANDS = ("README.md", "docs", "scripts")     # linked into the scratch folder
MARK = re.compile(r"<!--\s*test:\s*(\w+)\s*-->")
SEPARATORS = {"&&", "||", ";", "|", "&"}
NOT_IN_A_RUN = re.compile(r"(^|[\s;&|])(pip|pytest|python -m venv)\b")
MAX_LINES = 300


def bash_blocks(path=README):
    """[(mark or None, text, line number of the fence)] for every ```bash block of a Markdown file."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, previous, index = [], "", 0
    while index < len(lines):
        line = lines[index]
        if line.strip().startswith("```bash"):
            start, body = index + 1, []
            index += 1
            while not lines[index].strip().startswith("```"):
                body.append(lines[index])
                index += 1
            mark = MARK.fullmatch(previous.strip())
            blocks.append((mark.group(1) if mark else None, "\n".join(body) + "\n", start))
        elif line.strip():
            previous = line
        index += 1
    return blocks


def simple_commands(block):
    """Each simple command of a block as a list of words: continuation lines joined, comments
    dropped, split at &&, ||, ;, | and &."""
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = []
        for token in lexer:
            if token in SEPARATORS:
                if words:
                    yield words
                words = []
            else:
                words.append(token)
        if words:
            yield words


def cli_command(path):
    """The click command `npmegatron <path...>`, and the words of the path that were commands."""
    from npmegatron.cli import main
    command, used = main, 0
    while isinstance(command, click.Group) and used < len(path) and not path[used].startswith("-"):
        sub = command.get_command(click.Context(command), path[used])
        if sub is None:
            break
        command, used = sub, used + 1
    return command, used


def option_names(command):
    return {name for param in command.params for name in param.opts + param.secondary_opts} | {"-h", "--help"}


def long_flags(words):
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def check_command(words, where):
    """Problems with one simple command (empty when it names only what exists)."""
    problems = []
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):      # VAR=value before a command
        words = words[1:]
    if not words:
        return problems
    if words[0] in ("mpiexec", "mpirun"):
        if not (os.path.exists(os.path.join(os.path.dirname(sys.executable), words[0]))
                or shutil.which(words[0])):
            problems.append(f"{where}: {words[0]} is not installed")
        if words[1:2] != ["-n"] or not words[2:3] or not words[2].isdigit():
            return problems + [f"{where}: launch as `{words[0]} -n N ...`"]
        words = words[3:]
    if words[0] == "npmegatron":
        command, used = cli_command(words[1:])
        if used == 0:
            return problems + [f"{where}: `{' '.join(words[:2])}` is not a command"]
        unknown = [f for f in long_flags(words[1 + used:]) if f not in option_names(command)]
        if unknown:
            problems.append(f"{where}: `npmegatron {' '.join(words[1:1 + used])}` has no {', '.join(unknown)}")
    elif words[0] in ("python", "python3") and words[1] != "-m":
        if not os.path.isfile(os.path.join(ROOT, words[1])):
            problems.append(f"{where}: {words[1]} does not exist")
        if words[1] == "scripts/train.py":
            command, _ = cli_command(["train"])
            unknown = [f for f in long_flags(words[2:]) if f not in option_names(command)]
            if unknown:
                problems.append(f"{where}: scripts/train.py has no {', '.join(unknown)}")
    elif words[0] == "pytest":
        values = {i + 1 for i, w in enumerate(words) if w in ("-m", "-k", "-W")}
        for i, word in enumerate(words[1:], 1):
            if i not in values and not word.startswith("-") and not os.path.exists(
                    os.path.join(ROOT, word.split("::")[0])):
                problems.append(f"{where}: {word} does not exist")
    elif words[:3] == ["pip", "install", "-e"]:
        extras = re.fullmatch(r"\.\[([\w,]+)\]", words[3])
        provided = set(importlib.metadata.metadata("npmegatron").get_all("Provides-Extra") or [])
        for extra in extras.group(1).split(",") if extras else []:
            if extra not in provided:
                problems.append(f"{where}: setup.py has no extra {extra!r}")
    return problems


def test_readme_is_a_short_guide():
    with open(README, encoding="utf-8") as f:
        count = len(f.read().splitlines())
    assert count <= MAX_LINES, f"README.md has {count} lines; the user's guide keeps to {MAX_LINES}, the rest goes in docs/"


def test_every_command_and_flag_exists():
    problems = []
    for path in [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        for _, block, line in bash_blocks(path):
            for words in simple_commands(block):
                problems += check_command(words, f"{os.path.relpath(path, ROOT)}:{line}")
    assert not problems, "\n".join(problems)


def anchors(path):
    """GitHub's anchor for each heading of a Markdown file."""
    headings, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            fenced ^= line.startswith("```")
            if not fenced and re.match(r"#{1,6} ", line):
                headings.append(line.lstrip("#").strip())
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_links_between_the_pages_resolve():
    problems = []
    for path in [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            targets = re.findall(r"\]\(([^)\s]+)\)", f.read())
        for target in targets:
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(linked):
                problems.append(f"{os.path.relpath(path, ROOT)}: {target} does not exist")
            elif anchor and linked.endswith(".md") and anchor not in anchors(linked):
                problems.append(f"{os.path.relpath(path, ROOT)}: {target} names no heading")
    assert not problems, "\n".join(problems)


def test_marked_blocks_only_run_what_a_test_may():
    blocks = bash_blocks()
    assert {mark for mark, _, _ in blocks} <= {None, "quick", "slow"}
    for mark, block, line in blocks:
        if mark:
            assert not NOT_IN_A_RUN.search(block), f"README.md:{line}: a marked block may not install or run pytest"
    assert any(mark == "quick" for mark, _, _ in blocks)


def run_blocks(marks, folder, timeout):
    """Run the blocks with these marks in README order in `folder`, each with bash -euo pipefail;
    a block that fails or runs past `timeout` seconds fails the test with its output."""
    for name in READ_BY_COMMANDS:
        os.symlink(os.path.join(ROOT, name), folder / name)
    env = rank_environment({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    for mark, block, line in bash_blocks():
        if mark not in marks:
            continue
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=folder, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"README.md:{line}: the block ran past {timeout} s\n{block}\n{output}")
        assert proc.returncode == 0, f"README.md:{line}: the block failed (exit {proc.returncode})\n{block}\n{output}"


def test_quick_blocks_run(tmp_path):
    run_blocks({"quick"}, tmp_path, timeout=120)


@pytest.mark.slow
def test_quick_and_slow_blocks_run(tmp_path):
    run_blocks({"quick", "slow"}, tmp_path, timeout=300)
