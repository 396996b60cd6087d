"""The README's commands and examples stay true."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


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
