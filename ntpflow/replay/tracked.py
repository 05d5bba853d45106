"""What an attribution tracks: the run's sites, checked against its model, and its task's features, read by the run's
final ridge probes (fitted first if absent)."""

from collections.abc import Sequence

from ntpflow.engine.influence import Probe
from ntpflow.model.sites import Site, checked_sites, feature_name
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run


def check_features(run: Run, features: Sequence[str] | None) -> None:
    """ValueError (one line) for a name in ``features`` that is not one of the run's task features; called before an
    output folder is made."""
    known = list(run.task.feature_names)
    unknown = [n for n in (feature_name(f) for f in features or ()) if n not in known]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; the task has {known}")


def make_probes(run: Run, sites: Sequence[Site], features: Sequence[str] | None, device="auto") -> list[Probe]:
    """Probe directions of the run's final ridge probes (fitted first if absent) at ``sites`` × ``features``."""
    probes = load_or_probe(run, "final", device)
    if probes.metadata.get("config_hash") != run.cfg.hash():
        raise ValueError(f"the probes in {run.probes_dir('final')} were fitted on another run")
    names = [feature_name(f) for f in features] if features else list(probes.feature_names)
    unknown = [n for n in names if n not in probes.feature_names]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; the task has {list(probes.feature_names)}")
    out = []
    for s in sites:
        s.check(run.model_config().n_layer, run.task.seq_len)
        if s.pos not in probes.positions:
            raise ValueError(f"site {s} has no probe (probed positions: {probes.positions[0]}..{probes.positions[-1]})")
        out += [Probe(s, n, probes.direction(s.layer, s.pos, n)) for n in names]
    return out




def run_sites(run: Run, sites: Sequence[Site]) -> list[Site]:
    """The distinct ``sites``, sorted, checked against the run's model (before anything is written); at least one."""
    sites = checked_sites(sites, run.model_config().n_layer, run.task.seq_len)
    if not sites:
        raise ValueError("no sites to attribute")
    return sites


