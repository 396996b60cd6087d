"""docs/paper_settings.md's table of every preset value is the one the code renders."""

import os
import re

from experiments.config import settings_table
from experiments import paper_settings

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "paper_settings.md")
REGENERATE = ('python -c "from experiments.config import settings_table; print(settings_table())" and paste it '
              "between the settings table markers of docs/paper_settings.md")


def _documented() -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    found = re.search(r"<!-- settings table: begin -->\n(.*?)\n<!-- settings table: end -->", text, re.S)
    assert found, "docs/paper_settings.md lost its settings table markers"
    return found.group(1)


def test_the_documented_table_is_the_rendered_one():
    assert _documented() == settings_table(), f"the settings changed: run {REGENERATE}"


def test_the_table_has_every_value_of_every_preset_with_its_source():
    rows = {line.split(" | ")[0].lstrip("| ") for line in settings_table().splitlines()[2:]}
    header = settings_table().splitlines()[0]
    assert header == "| field | no setting | " + " | ".join(paper_settings.PRESETS) + " |"
    for name, preset in paper_settings.PRESETS.items():
        for method in preset.methods:
            for section, fields in preset.values(method).items():
                for key in fields:
                    if (section, key) != ("algorithm", "algorithm"):
                        assert f"`{section}.{key}`" in rows or f"`{section}.{key}` ({method})" in rows, (name, key)
    # Each cell a preset fills says where its value comes from.
    for line in settings_table().splitlines()[2:]:
        for cell in line.strip("| ").split(" | ")[2:]:
            assert cell in ("-", "as a", "as e") or re.search(r"` \[(paper|1gpu|8gpu|podsjax)\]", cell), line
