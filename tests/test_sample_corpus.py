"""The TinyStories sample shipped as package data (ntpflow/data/tinystories-sample, in the wheel too): its licence
notice, its hashes checked at every load, and the stories small scale's default corpus."""

import hashlib
import importlib.resources
import shutil
from pathlib import Path

import pytest

from ntpflow.cli import main
from ntpflow.experiments.stories import SCALES, check_corpus
from ntpflow.tasks.stories import corpus as C

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "ntpflow" / "data" / "tinystories-sample"


def test_sample_is_package_data_found_by_importlib_resources():
    """The sample is found through the package (importlib.resources), not beside a repository checkout, with its
    licence notice and SHA256SUMS; each file's SHA-256 matches SHA256SUMS; pyproject ships all four in the wheel."""
    folder = importlib.resources.files("ntpflow") / "data" / "tinystories-sample"
    names = {"README.md", "SHA256SUMS", "train.txt", "valid.txt"}
    assert names <= {f.name for f in folder.iterdir()}
    assert Path(str(folder)).resolve() == C.SAMPLE_DIR.resolve() == C.sample_dir().resolve()
    sums = dict(reversed(line.split()) for line in folder.joinpath("SHA256SUMS").read_text().splitlines())
    assert sums == {n: hashlib.sha256(folder.joinpath(n).read_bytes()).hexdigest() for n in ("train.txt", "valid.txt")}
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ntpflow"]
    assert "data/tinystories-sample/*" in data


def test_sample_ships_with_licence_source_and_hashes():
    readme = (SAMPLE / "README.md").read_text()
    assert "CDLA-Sharing-1.0" in readme and "roneneldan/TinyStories" in readme
    sums = dict(reversed(line.split()) for line in (SAMPLE / "SHA256SUMS").read_text().splitlines())
    actual = {name: hashlib.sha256((SAMPLE / name).read_bytes()).hexdigest() for name in ("train.txt", "valid.txt")}
    assert sums == actual == C.SAMPLE_SHA256  # the listed, the real and the pinned hashes agree
    assert sum((SAMPLE / n).stat().st_size for n in actual) < 4_000_000  # a few MB


def test_sample_loads_every_story():
    got = C.load_corpus("sample")
    for split, name in ((got.train, "train.txt"), (got.eval, "valid.txt")):
        text = (SAMPLE / name).read_text()
        assert len(split) == len([s for s in text.split("<|endoftext|>") if s.strip()])
    assert SCALES["small"].corpus == "sample"


def test_changed_sample_is_a_one_line_error(tmp_path, monkeypatch):
    copy = tmp_path / "sample"
    shutil.copytree(SAMPLE, copy)
    data = bytearray((copy / "valid.txt").read_bytes())
    data[100] ^= 1
    (copy / "valid.txt").write_bytes(bytes(data))
    monkeypatch.setattr(C, "SAMPLE_DIR", copy)
    with pytest.raises(ValueError, match=r"valid.txt does not match its SHA-256"):
        check_corpus("sample", "small")
    with pytest.raises(ValueError, match="SHA-256"):
        C.load_corpus("sample")
    (copy / "train.txt").unlink()
    with pytest.raises(FileNotFoundError, match="lacks train.txt"):
        C.sample_dir()
    monkeypatch.setattr(C, "SAMPLE_DIR", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="ships in the ntpflow package"):
        C.sample_dir()


def test_reproduce_stories_small_checks_the_sample_before_writing(tmp_path, monkeypatch, capsys):
    """`reproduce stories --scale small` needs no --corpus: it loads the shipped sample, and a changed sample stops
    it in one line before anything is written."""
    pytest.importorskip("spacy")
    pytest.importorskip("tokenizers")
    copy = tmp_path / "sample"
    shutil.copytree(SAMPLE, copy)
    (copy / "train.txt").write_text("Once upon a time.\n<|endoftext|>\n")
    monkeypatch.setattr(C, "SAMPLE_DIR", copy)
    out = tmp_path / "out"
    assert main(["reproduce", "stories", "--scale", "small", "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.txt does not match its SHA-256" in err[0], err
    assert not out.exists()


def test_report_names_the_shipped_sample_by_folder_licence_and_hashes():
    from ntpflow.experiments.stories_report import _corpus_text

    text = _corpus_text("sample")
    assert text.startswith("ntpflow/data/tinystories-sample") and "CDLA-Sharing-1.0" in text
    for name in ("train.txt", "valid.txt"):
        assert f"{name} {hashlib.sha256((SAMPLE / name).read_bytes()).hexdigest()[:12]}…" in text
    assert _corpus_text(text) == text  # a re-render from summary.json keeps it
    assert _corpus_text("/home/me/stories") == "local folder 'stories'"
