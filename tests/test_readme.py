"""The README's commands and examples stay true."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def all_python_blocks():
    """(id, code) of every python example in the README and in docs/."""
    blocks = [(f"README.md-{i}", code) for i, code in enumerate(python_blocks(README))]
    for page in DOCS:
        blocks += [(f"docs/{page.name}-{i}", code) for i, code in enumerate(python_blocks(page.read_text()))]
    return blocks


@pytest.mark.slow
def test_usage_example_runs():
    section = README.split("## Using the selector and the loss in your own JAX code", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["loss"].shape == (2,)


def test_ci_runs_exactly_the_readme_test_command():
    commands = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    test_line = [line for line in commands.splitlines() if "pytest" in line]
    assert len(test_line) == 1
    readme_test_command = test_line[0].split("&&")[-1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines[-1] == readme_test_command


def test_the_readme_has_the_examples_it_promises():
    # Selector and loss, rules, models and generation, rewards, one training step.
    assert len(python_blocks(README)) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("name,code", all_python_blocks(), ids=[name for name, _ in all_python_blocks()])
def test_every_python_example_runs_as_a_script(name, code, tmp_path):
    # As a file from the repository root, as a user would run it: the rewards example
    # starts worker processes that re-import the script (its __main__ guard).
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=os.environ.copy(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
