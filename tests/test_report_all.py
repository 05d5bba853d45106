"""The combined report: claims of every experiment, links to sections, every figure; rendered in headless Chromium."""

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ntpflow.cli import main
from ntpflow.experiments.report_all import write_report

TOY = Path(__file__).resolve().parents[1] / "docs" / "results" / "toy-small"


@pytest.fixture()
def combined(tmp_path) -> Path:
    shutil.copytree(TOY, tmp_path / "toy")
    write_report(tmp_path)
    return tmp_path


def test_report_gathers_claims_sections_and_figures(combined):
    html = (combined / "report.html").read_text()
    claims = __import__("json").loads((TOY / "summary.json").read_text())["claims"]
    table = html[html.index('<table id="claims">'):html.index("</table>")]
    assert table.count("<tr>") == len(claims) + 1  # header + one row per claim
    for c in claims:
        assert c["verdict"] in table
    assert '<a href="#toy">toy</a>' in html and '<h2 id="toy">' in html
    pngs = sorted((TOY / "figures").glob("*.png"))
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert sorted(base64.b64decode(i) for i in imgs) == sorted(p.read_bytes() for p in pngs)
    assert "http://" not in html and "https://" not in html  # self-contained: nothing to fetch
    md = (combined / "report.md").read_text()
    assert all(f"toy/figures/{p.stem}.png" in md for p in pngs)


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
  const rows = t ? t.tBodies[0].rows.length : -1;
  const visible = t ? t.getBoundingClientRect().height > 0 : false;
  document.body.setAttribute('data-check', `images=${imgs.length} broken=${broken} claims=${rows} visible=${visible}`);
});
</script></body>"""))
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    check = re.search(r'data-check="([^"]+)"', dom).group(1)
    n_png = len(list((TOY / "figures").glob("*.png")))
    n_claims = len(__import__("json").loads((TOY / "summary.json").read_text())["claims"])
    assert check == f"images={n_png} broken=0 claims={n_claims} visible=true"

    shot = tmp_path / "shot.png"
    subprocess.run([*flags, "--window-size=1280,2400", f"--screenshot={shot}", (combined / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    from PIL import Image

    img = Image.open(io.BytesIO(shot.read_bytes())).convert("L")
    assert img.size == (1280, 2400)
    lo, hi = img.getextrema()
    assert hi - lo > 100  # not a blank page: text and figures drawn
