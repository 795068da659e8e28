"""The layers are a contract (.importlinter, docs/design.md), checked here with import-linter and
grimp, which see imports inside functions too. The package is laid out as the wheel installs it
(autograd/ and comm/ inside npmegatron/): an editable install maps those folders from elsewhere,
where the import graph would not find them."""
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

PACKAGE_FOLDERS = {"npmegatron": "npmegatron", "autograd": "npmegatron/autograd", "comm": "npmegatron/comm"}


@pytest.fixture
def installed_layout(tmp_path):
    """A copy of the package as it is installed, importable from tmp_path."""
    for source, target in PACKAGE_FOLDERS.items():
        shutil.copytree(os.path.join(ROOT, source), tmp_path / target,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tmp_path


def run_with(layout, code_or_args):
    env = {**os.environ, "PYTHONPATH": str(layout)}
    args = code_or_args if isinstance(code_or_args, list) else [sys.executable, "-c", code_or_args]
    # from `layout`: the checkout's own npmegatron/ must not be found first
    return subprocess.run(args, capture_output=True, text=True, cwd=layout, env=env, timeout=300)


def lint_imports(layout):
    command = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    return run_with(layout, [command, os.path.join(ROOT, ".importlinter"), "--no-cache"])


def test_every_import_goes_down_the_layers(installed_layout):
    result = lint_imports(installed_layout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken" in result.stdout, result.stdout


def test_an_upward_import_inside_a_function_breaks_the_contract(installed_layout):
    engine = installed_layout / "npmegatron" / "autograd" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _upward():\n    from npmegatron.training import trainer\n")
    result = lint_imports(installed_layout)
    assert result.returncode != 0, result.stdout
    assert "npmegatron.autograd.engine -> npmegatron.training.trainer" in result.stdout, result.stdout


STRONGLY_CONNECTED = """
import grimp, sys
graph = grimp.build_graph("npmegatron")
edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
index, low, stack, on_stack, circles = {}, {}, [], set(), []
sys.setrecursionlimit(10000)

def visit(m):
    index[m] = low[m] = len(index)
    stack.append(m); on_stack.add(m)
    for n in edges[m]:
        if n not in index:
            visit(n); low[m] = min(low[m], low[n])
        elif n in on_stack:
            low[m] = min(low[m], index[n])
    if low[m] == index[m]:
        component = []
        while True:
            n = stack.pop(); on_stack.discard(n); component.append(n)
            if n == m:
                break
        if len(component) > 1:
            circles.append(sorted(component))

for m in sorted(graph.modules):
    if m not in index:
        visit(m)
print(len(graph.modules), "modules")
print(circles)
"""


def test_no_import_circle_among_modules(installed_layout):
    """Tarjan's strongly connected components over grimp's module graph (every import, wherever
    it is written): a component of more than one module is a circle."""
    result = run_with(installed_layout, STRONGLY_CONNECTED)
    assert result.returncode == 0, result.stderr
    count, circles = result.stdout.splitlines()
    assert int(count.split()[0]) > 90 and circles == "[]", result.stdout
