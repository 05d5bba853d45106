"""The README's Python example runs and its printed identity holds."""

import re
from pathlib import Path


def test_readme_example_runs(capsys):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    errors = [float(x) for x in re.findall(r"sum error ([0-9.e+-]+)", out)]
    assert len(errors) == 2 and max(errors) < 1e-5
