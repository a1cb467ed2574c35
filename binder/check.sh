#!/usr/bin/env bash
# Build the Binder environment (binder/requirements.txt, then binder/postBuild) in a fresh virtual
# environment, as repo2docker would, and run every tutorial under nbval in it.
# Usage: bash binder/check.sh [results.md]      (default: binder/check-results.md)
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-binder/check-results.md}
env_dir=$(mktemp -d)
trap 'rm -rf "$env_dir"' EXIT

python3 -m venv "$env_dir"
# shellcheck disable=SC1091
. "$env_dir/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
started=$(date +%s)
pip install -q --retries 1 --timeout 15 -r binder/requirements.txt
bash binder/postBuild > /dev/null
pip install -q nbval   # the checker only; Binder users do not need it
built=$(date +%s)
python -m pytest -p no:cacheprovider --rootdir=. -o addopts="" --nbval --nbval-current-env \
    notebooks/ 2>&1 | tee "$env_dir/nbval.log"
finished=$(date +%s)

{
    echo "# Binder environment check"
    echo
    echo "- date: $(date -u +%Y-%m-%d), python $(python -c 'import platform; print(platform.python_version())')"
    echo "- built from binder/requirements.txt + binder/postBuild in a fresh venv in $((built - started)) s"
    echo "- versions: $(python -c 'import torch, ipywidgets, matplotlib, jupyterlab, batchwidgets as b; print(f"torch {torch.__version__}, ipywidgets {ipywidgets.__version__}, matplotlib {matplotlib.__version__}, jupyterlab {jupyterlab.__version__}, batchwidgets {b.__version__}")')"
    echo "- nbval over notebooks/ in $((finished - built)) s: $(tail -n 1 "$env_dir/nbval.log" | tr -d '=')"
} > "$results"
cat "$results"
