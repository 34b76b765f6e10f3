"""The README's Python examples run as printed."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    scope: dict = {}
    for block in blocks:  # later blocks use names from earlier ones, as a reader would run them
        exec(compile(block, str(README), "exec"), scope)
    assert scope["dispatched"].backend == "native" and scope["result"].per_sequence_policy.shape == (8,)
