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


def test_readme_cli_lines_name_real_commands_and_docs_exist():
    from ntpflow.cli import build_parser

    root = Path(__file__).parents[1]
    text = (root / "README.md").read_text()
    block = text[text.index("## Command line at a glance"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    used = {line.split()[1] for line in block.splitlines() if line.startswith("ntpflow ")}
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert used and used <= set(sub.choices)
    for link in re.findall(r"\]\(((?:docs/|BENCHMARKS)[^)#]+)\)", text):
        assert (root / link).exists(), link


def test_readme_python_api_example_runs(tmp_path, monkeypatch, capsys):
    """The README's "Python API" block runs as written (in a scratch folder) and prints what it says."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "torch.Size([8, 21, 5]) torch.Size([8, 21, 32])" in out
    assert re.search(r"^4 False \{'direct'", out, re.M) and re.search(r"^14 True \{'direct'", out, re.M)
    assert (tmp_path / "runs/maj/att/report/report.html").exists()
