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
if [ $# -gt 0 ]; then
    echo "== pytest $*"
    exec python -m pytest "$@"
fi

# A full run, in two phases. The engine plugin on every supported vLLM release and vLLM's
# own scheduler tests of each (scripts/test_vllm_releases.sh, releases installed by
# setup.sh into .cache/) run in-process with fake clocks: they go beside the tests that
# start no vLLM server, each on one of the two cores. The e2e tests (marker e2e: real vLLM
# servers, rates measured against baselines in the same test) then run alone.
releases_log=$(mktemp)
bash scripts/test_vllm_releases.sh >"$releases_log" 2>&1 &
releases=$!
failed=()
echo "== pytest: every test but the e2e ones, on two workers (the vLLM releases' part runs beside it)"
# Most of these tests wait on real processes, sockets and timers rather than compute, so two
# workers (one test file each at a time: a file's servers are started once) overlap the waits.
python -m pytest -m "not e2e" -n 2 --dist loadfile || failed+=("pytest -m 'not e2e'")
wait "$releases" || failed+=("scripts/test_vllm_releases.sh")
echo "== vLLM releases"
cat "$releases_log"
rm -f "$releases_log"
echo "== pytest: the e2e tests"
python -m pytest -m e2e || failed+=("pytest -m e2e")
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
