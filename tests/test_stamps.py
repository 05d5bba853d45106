"""Every result says who made it (files.stamp), and a report re-rendered from its summary.json changes no byte."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from test_toy_report import make_data, write_data

from ntpflow import __version__
from ntpflow.experiments.render import STAMP
from ntpflow.experiments.toy_report import write_report
from ntpflow.files import command_line, stamp, stamp_text, write_json

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"ntpflow", "git_commit", "git_dirty", "date", "command"}


def files_of(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_stamp_names_version_commit_date_and_command():
    s = stamp(["/usr/bin/ntpflow", "reproduce", "toy", "--corpus", "my stories"])
    assert set(s) == KEYS
    assert s["ntpflow"] == __version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s["date"])
    assert s["command"] == "ntpflow reproduce toy --corpus 'my stories'"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if head.returncode == 0:  # a git checkout: its HEAD, and a dirty flag
        assert s["git_commit"] == head.stdout.strip() and isinstance(s["git_dirty"], bool)
    else:
        assert (s["git_commit"], s["git_dirty"]) == ("unknown", None)
    assert stamp_text(s).startswith(f"Made by ntpflow {__version__} (commit {s['git_commit'][:12]}")
    assert "Note" not in stamp_text(s)
    assert stamp_text({**s, "note": "trained at abc"}).endswith("`. Note: trained at abc")


def test_pyproject_version_is_the_stamped_one():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == __version__


def test_command_line_names_entry_points():
    pkg = ROOT / "ntpflow"
    assert command_line([str(pkg / "__main__.py"), "train", "--out", "a b"]) == "ntpflow train --out 'a b'"
    assert command_line([str(pkg / "experiments" / "toy_report.py"), "OUT"]) == \
        "python -m ntpflow.experiments.toy_report OUT"
    assert command_line(["script.py", "x"]) == "script.py x"


def test_git_state_outside_a_checkout_is_unknown(tmp_path):
    """An installed copy (no .git above it) stamps "unknown": run the function from a copy of files.py."""
    shutil.copy(ROOT / "ntpflow" / "files.py", tmp_path / "files_copy.py")
    code = "import files_copy, json; print(json.dumps(files_copy.git_state()))"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "GIT_CEILING_DIRECTORIES":
                              str(tmp_path.parent)})
    assert json.loads(res.stdout) == [None, None]


def test_report_carries_the_stamp_and_rerenders_byte_identical(tmp_path):
    """A results folder's stamp.json goes into summary.json and the report's last line; rendering again, from
    data.json or from summary.json alone (as a committed folder holds), changes no byte."""
    d = write_data(tmp_path / "toy", make_data())
    made = {**stamp(["ntpflow", "reproduce", "toy"]), "date": "2000-01-01T00:00:00Z"}
    write_json(d / STAMP, made)
    write_report(d)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["stamp"] == made
    assert (d / "report.md").read_text().rstrip().endswith(stamp_text(made))
    first = files_of(d)
    write_report(d)
    assert files_of(d) == first  # from data.json again

    committed = tmp_path / "committed"
    committed.mkdir()
    for name in ("summary.json", "report.md"):
        shutil.copy(d / name, committed / name)
    write_report(committed)  # only the stored numbers: no data.json, no stamp.json
    assert (committed / "summary.json").read_bytes() == first["summary.json"]
    assert (committed / "report.md").read_bytes() == first["report.md"]


def test_fresh_and_stored_render_list_rows_alike(tmp_path):
    """Regimes in a data.json order differ from summary.json's sorted keys: both renders give one row order."""
    d = write_data(tmp_path / "toy", make_data())
    write_report(d)
    md = (d / "report.md").read_text()
    (d / "data.json").unlink()
    write_report(d)
    assert (d / "report.md").read_text() == md
    rows = [line.split(" | ")[1] for line in md.splitlines() if line.startswith("| majority | ")]
    assert rows[:4] == ["vanilla", "myopic", "untied", "myopic-untied"]  # the regimes' own order, not sorted
