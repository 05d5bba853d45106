"""The combined report: claims of every experiment, links to sections, every figure; rendered in headless Chromium."""

import base64
import io
import json
import re
import shutil
import subprocess
from html import escape as html_escape
from pathlib import Path

import pytest

from ntpflow.cli import main
from ntpflow.experiments.report_all import write_report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
EXPERIMENTS = ("toy", "othello", "stories", "llm")
# the committed results of each experiment: toy at the medium scale (the paper's model), the others at small
DIRS = {"toy": "toy-medium", "othello": "othello-small", "stories": "stories-small", "llm": "llm-small"}
NAME_OF = {d: n for n, d in DIRS.items()}


@pytest.fixture()
def combined(tmp_path) -> Path:
    for name in EXPERIMENTS:
        shutil.copytree(RESULTS / DIRS[name], tmp_path / name, ignore=shutil.ignore_patterns("report.html"))
    write_report(tmp_path)
    return tmp_path


def _claims():
    return [(n, c) for n in EXPERIMENTS for c in json.loads((RESULTS / DIRS[n] / "summary.json").read_text())["claims"]]


def _captions():
    """{experiment/stem: caption} as each experiment's own summary.json records them."""
    out = {}
    for n in EXPERIMENTS:
        for f in json.loads((RESULTS / DIRS[n] / "summary.json").read_text()).get("figures", []):
            out[f"{n}/{f['name']}"] = f["caption"]
    return out


def test_report_gathers_claims_sections_and_figures(combined):
    html = (combined / "report.html").read_text()
    claims = _claims()
    table = html[html.index('<table id="claims">'):html.index("</table>")]
    assert table.count("<tr>") == len(claims) + 1  # header + one row per claim
    for name, c in claims:
        assert c["verdict"] in table
        if c.get("paper"):  # the paper's value of every claim that has one is in the paper column
            assert html_escape(c["paper"]) in table
    for name in EXPERIMENTS:
        assert f'<a href="#{name}">{name}</a>' in html and f'<h2 id="{name}">' in html
        assert f'<a href="{name}/report.html">{name}/report.html</a>' in html  # a real link, not plain text
    pngs = sorted(p for n in EXPERIMENTS for p in (RESULTS / DIRS[n] / "figures").glob("*.png"))
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert sorted(base64.b64decode(i) for i in imgs) == sorted(p.read_bytes() for p in pngs)
    captions = _captions()
    assert captions  # the re-rendered results record their captions
    for key, caption in captions.items():  # the experiment's own caption, not "toy: influence bars"
        assert html_escape(f"{key.split('/')[0]}: {caption}") in html
    assert "http://" not in html and "https://" not in html  # self-contained: nothing to fetch
    md = (combined / "report.md").read_text()
    assert all(f"{NAME_OF[p.parent.parent.name]}/figures/{p.stem}.png" in md for p in pngs)
    summary = json.loads((combined / "summary.json").read_text())
    assert len(summary["claims"]) == len(claims) and summary["experiments"] == list(EXPERIMENTS)


def test_no_results_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no experiment results"):
        write_report(tmp_path)
    assert main(["-q", "reproduce", "nonsense", "--out", str(tmp_path / "x")]) == 2
    assert "unknown experiment 'nonsense'" in capsys.readouterr().err


def _chromium() -> str | None:
    return next((shutil.which(c) for c in ("chromium", "chromium-browser") if shutil.which(c)), None)


@pytest.mark.slow
def test_report_renders_in_headless_chromium(combined, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("Debian's chromium package is not installed (apt-get install chromium)")
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000"]
    # the same page plus a script that reports what the browser rendered
    probe = combined / "probe.html"
    probe.write_text((combined / "report.html").read_text().replace("</body>", """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const broken = imgs.filter(i => !i.complete || i.naturalWidth === 0).length;
  const t = document.getElementById('claims');
  const rows = t ? [...t.tBodies[0].rows] : [];
  const col = t ? [...t.tHead.rows[0].cells].findIndex(c => c.textContent === 'paper') : -1;
  const paper = rows.filter(r => col >= 0 && !['', 'n/a'].includes(r.cells[col].textContent.trim())).length;
  const visible = t ? t.getBoundingClientRect().height > 0 : false;
  const caps = [...document.querySelectorAll('figcaption')].filter(c => c.textContent.length > 60).length;
  const links = [...document.querySelectorAll('a[href$="/report.html"]')].map(a => a.getAttribute('href')).join(',');
  document.body.setAttribute('data-check', `images=${imgs.length} broken=${broken} claims=${rows.length} ` +
    `paper=${paper} visible=${visible} captions=${caps} links=${links}`);
});
</script></body>"""))
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    check = re.search(r'data-check="([^"]+)"', dom).group(1)
    n_png = sum(len(list((RESULTS / DIRS[n] / "figures").glob("*.png"))) for n in EXPERIMENTS)
    claims = _claims()
    n_paper = sum(1 for _, c in claims if c.get("paper"))
    assert n_paper == len(claims)  # every claim states the paper's value (or that it gave none)
    links = ",".join(f"{n}/report.html" for n in EXPERIMENTS)
    n_captions = len(_captions())  # figures whose own report recorded a caption (each longer than 60 characters)
    assert n_captions >= n_png - 5
    assert check == (f"images={n_png} broken=0 claims={len(claims)} paper={n_paper} visible=true "
                     f"captions={n_captions} links={links}")

    shot = tmp_path / "shot.png"
    subprocess.run([*flags, "--window-size=1280,2400", f"--screenshot={shot}", (combined / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    from PIL import Image

    img = Image.open(io.BytesIO(shot.read_bytes())).convert("L")
    assert img.size == (1280, 2400)
    lo, hi = img.getextrema()
    assert hi - lo > 100  # not a blank page: text and figures drawn
