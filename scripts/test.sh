#!/usr/bin/env bash
# The test command: set up, then lint, type-check and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${OUTPUT_RATE_VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"

# PostgreSQL is started by this machine kind; start it if it is down.
if command -v pg_ctlcluster >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start || true
fi

echo "== ruff"
ruff check output_rate_core control_plane engine_ext migrations harness tests scripts bench setup.py
ruff format --check output_rate_core control_plane engine_ext migrations harness tests scripts bench setup.py
echo "== biome (web/: format, lint, import order; warnings fail too)"
(cd web && node_modules/.bin/biome ci --error-on-warnings)
echo "== mypy"
mypy
echo "== pytest"
python -m pytest "$@"

# The engine plugin on every supported vLLM release, and vLLM's own scheduler tests of each
# with the plugin's schedulers (the releases are installed by setup.sh into .cache/). Only
# in a full run: arguments select tests of the main run above.
if [ $# -eq 0 ]; then
    echo "== vLLM releases"
    bash scripts/test_vllm_releases.sh
fi
