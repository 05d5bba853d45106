#!/usr/bin/env bash
# Create .venv with ntpflow and its test dependencies; torch is pinned to the CPU wheel (constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
