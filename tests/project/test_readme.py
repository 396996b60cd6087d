"""The commands and examples of the README and of docs/ stay true."""

import ast
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# Every page: the guides in docs/, the results in docs/results/, and the changelog.
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = ["README.md", "CHANGELOG.md", *(page.relative_to(ROOT).as_posix() for page in DOCS)]


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def all_python_blocks():
    """(id, code) of every python example in the README, the changelog and docs/."""
    return [(f"{page}-{i}", code) for page in PAGES for i, code in enumerate(python_blocks((ROOT / page).read_text()))]


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


def test_the_readme_opens_with_the_two_set_up_commands():
    assert README.index("```bash\n") < README.index("\n## "), "the commands come before the first section"
    block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    run, test = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    venv = "python3 -m venv .venv && "
    # The command lines need the run extra; the bare install is the library alone.
    assert run.startswith(venv + ".venv/bin/pip install -e '.[run]' && .venv/bin/python -m experiments.gsm8k "), run
    # The test extra, and the deviceless compilers that the GPU and TPU plan tests need.
    assert test == venv + ".venv/bin/pip install -e '.[test,topology]' && .venv/bin/python -m pytest", test
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/pip install -q -e '.[test,topology]'\n" in ci, ci


def fences(text):
    """(section heading, language) of every fenced block, from the fences' lines."""
    heading, found, inside = None, [], False
    for line in text.splitlines():
        if not inside and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.lstrip().startswith("```"):
            if not inside:
                found.append((heading, line.strip()[3:]))
            inside = not inside
    assert not inside, "a fence is left open"
    return found


def test_the_readme_and_the_library_guide_have_the_examples_they_promise():
    # test_every_python_example_runs_as_a_script runs each.
    assert [heading for heading, language in fences(README) if language == "python"] == [
        "Using the selector and the loss in your own JAX code"]
    library = (ROOT / "docs" / "library.md").read_text()
    assert [heading for heading, language in fences(library) if language == "python"] == [
        "Rules by name, and your own", "Bring your own trainer", "Models: loading, LoRA, generation, export",
        "Rewards", "One training step in your own code", "Hooks on the loop"]


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_is_run_or_checked(page):
    text = (ROOT / page).read_text()
    # A fence without a language, or a misspelt one, would escape the python examples' run.
    assert {language for _, language in fences(text)} <= {"python", "bash", "yaml", "text"}
    # Every module the commands run is in this repository or its test dependencies.
    for module in set(re.findall(r"python3? -m ([A-Za-z_]\w*(?:\.\w+)*)", text)):
        assert importlib.util.find_spec(module) is not None, f"{page} runs `python -m {module}`, which is not there"


def test_the_python_examples_import_from_where_modules_are_now():
    from podsjax.moved import new_path

    old = []
    for name, code in all_python_blocks():
        if name.startswith("CHANGELOG.md"):  # history shows the paths of its day
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                paths = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                paths = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            old += [f"{name}: {path} (now {new_path(path)})" for path in paths if new_path(path)]
    assert not old, "examples import moved modules through their old paths:\n" + "\n".join(old)


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


def heading_anchors(text):
    """GitHub's anchors for the headings of a markdown page (code blocks left out)."""
    anchors, inside = set(), False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            anchor, count = slug, 1
            while anchor in anchors:
                anchor, count = f"{slug}-{count}", count + 1
            anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("page", PAGES)
def test_every_link_between_pages_finds_its_page_and_heading(page):
    path = ROOT / page
    for target, anchor in re.findall(r"\]\((?!https?:|mailto:)([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
        linked = (path.parent / target).resolve() if target else path
        assert linked.exists(), f"{page} links to {target}, which is not there"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked.read_text()), f"{page} links to {target}#{anchor}: no such heading"


def test_docs_holds_the_guides_and_the_results_folder_holds_the_results():
    # Result files (run summaries, plots) go beside the results page, not among the guides.
    strays = sorted(path.name for path in (ROOT / "docs").iterdir() if path.is_file() and path.suffix != ".md")
    assert not strays, f"docs/ holds files other than pages: {', '.join(strays)}; results go in docs/results/"
    assert (ROOT / "docs" / "results" / "README.md").is_file(), "docs/results/README.md, the results page, is missing"
    assert not (ROOT / "docs" / "changes.md").exists(), "the changelog is CHANGELOG.md at the repository root"
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog\n"), "CHANGELOG.md opens with its title"
    assert "\n## Unreleased\n" in (ROOT / "CHANGELOG.md").read_text(), "CHANGELOG.md has an Unreleased section"


def test_every_result_file_is_linked_from_the_results_page():
    folder = ROOT / "docs" / "results"
    page = (folder / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#\s/]+)\)", page))
    unlinked = sorted(path.name for path in folder.iterdir() if path.name != "README.md" and path.name not in linked)
    assert not unlinked, f"docs/results/README.md links no {', '.join(unlinked)}"
    for summary in folder.glob("*.json"):  # the plot it names lies beside it
        plot = json.loads(summary.read_text())["plot"]
        assert (folder / plot).is_file(), f"{summary.name} names the plot {plot}, which is not beside it"
