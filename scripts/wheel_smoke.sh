#!/usr/bin/env bash
# ntpflow as a library: build the wheel (dist/), install it with the stories and plot extras into a fresh venv in a
# temporary folder (torch pinned by constraints.txt), and, from outside the repository, (1) load the TinyStories
# sample through the package's API and check it comes from the installed package data, and (2) run the stories smoke
# on that sample with the installed `ntpflow` command (offline: HF_HUB_OFFLINE=1). The temporary folder is removed
# at the end (KEEP=1 keeps it). PYTHON picks the interpreter of the fresh venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ntpflow-wheel.XXXXXX")
[ "${KEEP:-0}" = 1 ] && echo "wheel smoke: keeping $WORK" || trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
unset PYTHONPATH

echo "wheel smoke: a fresh venv in $WORK/venv"
"${PYTHON:-python3}" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"

echo "wheel smoke: building the wheel (dist/)"
rm -f dist/ntpflow-*.whl
"$VPY" -m pip wheel -q --no-deps -w dist .
WHEEL=$(ls dist/ntpflow-*.whl)
"$VPY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = {f"ntpflow/data/tinystories-sample/{n}" for n in ("README.md", "SHA256SUMS", "train.txt", "valid.txt")}
assert need <= names, f"the wheel lacks {sorted(need - names)}"
EOF

echo "wheel smoke: pip install '$WHEEL[stories,plot]' -c constraints.txt"
"$VPY" -m pip install -q -c "$REPO/constraints.txt" "$REPO/$WHEEL[stories,plot]"

mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"
echo "wheel smoke: the sample through the installed package's API"
"$VPY" - "$REPO" <<'EOF'
import hashlib, sys
from pathlib import Path
import ntpflow
from ntpflow.tasks.stories.corpus import SAMPLE_SHA256, load_corpus, sample_dir
repo = Path(sys.argv[1]).resolve()
pkg = Path(ntpflow.__file__).resolve().parent
assert repo not in pkg.parents, f"ntpflow imported from the repository ({pkg}), not the installed wheel"
folder = sample_dir()
assert pkg in folder.parents, folder
sums = dict(reversed(line.split()) for line in (folder / "SHA256SUMS").read_text().splitlines())
assert sums == SAMPLE_SHA256 == {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in sums}
assert "CDLA-Sharing-1.0" in (folder / "README.md").read_text()
c = load_corpus("sample")
print(f"wheel smoke: ntpflow {ntpflow.__version__} at {pkg}; sample {folder}: {len(c.train)} train, "
      f"{len(c.eval)} eval stories")
EOF

echo "wheel smoke: ntpflow reproduce stories --scale smoke --corpus sample (installed command, outside the repository)"
"$WORK/venv/bin/ntpflow" reproduce stories --scale smoke --corpus sample --device cpu --out "$WORK/elsewhere/stories"
test -s "$WORK/elsewhere/stories/report.md"
echo "wheel smoke: passed ($WHEEL)"
