"""Results in Python and a report for any run: ``ntpflow.attribute`` returns an ``Attribution`` (its folder, summary,
rows, shares, plot, report) and ``ntpflow report`` draws it."""

import json

import pytest

import ntpflow
from ntpflow.cli import main
from ntpflow.tasks import make_task

TINY = dict(task="majority", n_layer=2, d_model=32, n_head=2, steps=10, batch_size=32, n_train=256, n_eval=128,
            eval_every=5, ckpt_every=5, log_every=5, device="cpu")


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
    run = ntpflow.train(ntpflow.TrainConfig(**TINY), tmp_path_factory.mktemp("rr") / "run", progress=False)
    att = ntpflow.attribute(run.dir, ntpflow.parse_sites("1:3,1:14"), ["is_majority_<0>"], out=run.dir / "mine",
                            progress=False)
    return run, att


def test_attribute_returns_results_at_the_folder_it_was_told(attributed):
    run, att = attributed
    assert isinstance(att, ntpflow.Attribution) and att.dir == run.dir / "mine" and (att / "summary.json").exists()
    summary = json.loads((run.dir / "mine" / "summary.json").read_text())
    assert att.summary == summary and att.own == "adam"
    task, j = make_task("majority"), make_task("majority").feature_names.index("is_majority_0")
    shares = att.shares("centred")
    assert {(s["pos"], s["useful"]) for s in shares} == {(p, bool(task.useful[p, j])) for p in (3, 14)}
    for s in shares:  # each share = the component's total / the exact change, from summary.json
        e = next(e for e in summary["probes"] if (e["pos"], e["mismatch"]) == (s["pos"], "centred"))
        for c in ("direct", "pre_cached", "shared"):
            assert s[c] == pytest.approx(e[f"adam_{c}"] / e["change"], rel=1e-12)
        assert s["direct"] + s["pre_cached"] + s["shared"] == pytest.approx(1.0, abs=0.01)  # the residual's 1 %
    assert len(att.rows) == att.table.num_rows and set(att.rows.columns) >= {"useful", "cumulative"}
    with pytest.raises(ValueError, match="out= .* once"):
        ntpflow.attribute(run.dir, ntpflow.parse_sites("1:3"), out="a", out_dir="b")


def test_plot_and_report(attributed, capsys):
    run, att = attributed
    fig = att.plot("bars")
    titles = sorted(ax.get_title() for ax in fig.axes if ax.get_visible())
    assert titles == ["NTP-useful, R (1 rows)", "NTP-useful, R_c (1 rows)", "NTP-useless, R (1 rows)",
                      "NTP-useless, R_c (1 rows)"]
    heights = {ax.get_title(): [b.get_height() for b in ax.patches] for ax in fig.axes}
    useless = next(s for s in att.shares("centred") if not s["useful"])
    assert heights["NTP-useless, R_c (1 rows)"] == pytest.approx([useless[c] for c in ("direct", "pre_cached", "shared")])
    assert len([ax for ax in att.plot("curves").axes if ax.get_visible()]) == 4
    assert main(["report", str(att.dir)]) == 0
    md, html = capsys.readouterr().out.split()
    assert md.endswith("report/report.md") and html.endswith("report/report.html")
    text = (att.dir / "report" / "report.md").read_text()
    assert all(line in text for line in att.lines()) and "NTP-useless" in text
    assert (att.dir / "report" / "figures" / "influence_bars.png").exists()


def test_report_refuses_what_is_not_an_attribution(attributed, tmp_path, capsys):
    run, _ = attributed
    for path, fragment in ((tmp_path / "none", "does not exist"), (tmp_path, "neither an attribution folder")):
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1


def test_train_returns_a_run_with_its_results(attributed):
    run, _ = attributed
    s = run.summary
    assert s["config"] == run.cfg.to_dict() and s["final"] == run.final_record() and s["checkpoints"] == [5]
    rows = run.rows
    assert list(rows[rows["kind"] == "eval"]["step"]) == [0, 5, 10]
    (ax,) = run.plot().axes
    assert sorted(line.get_label() for line in ax.get_lines()) == ["eval loss", "train loss"]
