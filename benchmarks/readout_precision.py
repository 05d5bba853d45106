"""How precisely a readout set of N sequences measures a feature's mismatch: R_H(θ₀) and R_c,H(θ₀) of a finished
run's probes on disjoint readout sets of N evaluation sequences each, for several N; prints, per N, the relative
spread sd / mean over the sets (the exact account splits R_H's change exactly for any N: N only sets how closely R_H
stands for the mismatch over the data).

    python benchmarks/readout_precision.py RUN_DIR --sites 1:4,1:6,1:8 --sizes 32,64,256,1024
"""

import argparse
import statistics

import torch

from ntpflow.engine.influence import MISMATCHES, mismatch_value
from ntpflow.model.sites import parse_sites
from ntpflow.replay.tracked import make_probes
from ntpflow.runs.run import Run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--sites", default="1:4,1:6,1:8")
    p.add_argument("--features", help="comma-separated (default: all of the task's)")
    p.add_argument("--sizes", default="32,64,256,1024")
    args = p.parse_args(argv)
    run = Run.open(args.run_dir)
    probes = make_probes(run, parse_sites(args.sites), args.features.split(",") if args.features else None, "cpu")
    tokens = torch.as_tensor(run.datasets()[1].tokens)
    with torch.no_grad():
        r0 = run.load_model("init")(tokens, return_resid=True, myopic="none")[1]
        r1 = run.load_model("final")(tokens, return_resid=True, myopic="none")[1]
    d = torch.stack([(r0[q.site.layer][:, q.site.pos] - r1[q.site.layer][:, q.site.pos]).double() @ q.w.double()
                     for q in probes], 1)  # [n_eval, probes]
    print(f"{run.name}: {len(probes)} probes, {len(tokens)} evaluation sequences; relative sd of R_H(θ₀) over "
          "disjoint readout sets (median over the probes)")
    print("| N | sets | R | R_c |")
    print("|---:|---:|---:|---:|")
    for n in (int(x) for x in args.sizes.split(",")):
        k = len(d) // n
        if k < 2:
            continue
        out = []
        for m in MISMATCHES:
            values = torch.stack([mismatch_value(d[j * n:(j + 1) * n], m) for j in range(k)])  # [sets, probes]
            rel = (values.std(0) / values.mean(0)).tolist()
            out.append(statistics.median(rel))
        print(f"| {n} | {k} | {out[0]:.3f} | {out[1]:.3f} |")


if __name__ == "__main__":
    main()
