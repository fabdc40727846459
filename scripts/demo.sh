#!/usr/bin/env bash
# The main job: control plane (SQLite) + a vLLM engine on the tiny local model.
# A tenant with more streams than the engine's resident slots starves a normal
# user until the operator gives it a limit over REST; the live view shows both
# users' tokens/s (as the engine granted them and as the client read them) and
# time to first token. A light load then keeps running
# (admin UI at http://127.0.0.1:8700/ui/) until Ctrl-C; DEMO_EXIT=1 stops
# after the showcase.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${OUTPUT_RATE_VENV:-$PWD/.venv}
PY="$VENV/bin/python"
DEMO_DIR=${DEMO_DIR:-$PWD/.cache/demo}
mkdir -p "$DEMO_DIR"

export OUTPUT_RATE_DATABASE_URL="sqlite:///$DEMO_DIR/output_rate.db"
export OUTPUT_RATE_ADMIN_TOKEN=${OUTPUT_RATE_ADMIN_TOKEN:-demo-admin-token}
export OUTPUT_RATE_PORT=${OUTPUT_RATE_PORT:-8700}
export OUTPUT_RATE_ZMQ_ENDPOINT=${OUTPUT_RATE_ZMQ_ENDPOINT:-tcp://127.0.0.1:5557}
ENGINE_PORT=${ENGINE_PORT:-8000}
CP=http://127.0.0.1:$OUTPUT_RATE_PORT
AUTH="Authorization: Bearer $OUTPUT_RATE_ADMIN_TOKEN"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
put() { curl -fsS -X PUT "$CP$1" -H "$AUTH" -H 'content-type: application/json' -d "$2"; echo; }
get() { curl -fsS "$CP$1" -H "$AUTH"; echo; }

say "control plane on $CP (log: $DEMO_DIR/control-plane.log)"
setsid "$PY" -m control_plane.cli serve >"$DEMO_DIR/control-plane.log" 2>&1 &
pids+=($!)
for _ in $(seq 60); do curl -fs "$CP/healthz" >/dev/null && break; sleep 0.5; done

say "tiers free=20 and pro=100 tok/s; user-a is free, user-b is pro"
put /tiers/free '{"output_tokens_per_second": 20, "description": "free tier"}'
put /tiers/pro '{"output_tokens_per_second": 100, "description": "paid tier"}'
put /limits/user-a '{"tier": "free"}'
put /limits/user-b '{"tier": "pro"}'
# The showcase starts with the tenant unlimited, also on a database kept from an earlier run.
curl -fsS -X DELETE "$CP/limits/tenant" -H "$AUTH"

say "vLLM engine on :$ENGINE_PORT, limits from the control plane (log: $DEMO_DIR/engine.log)"
VLLM_CPU_KVCACHE_SPACE=1 setsid "$PY" -m vllm.entrypoints.openai.api_server \
    --model .cache/tiny-llama --served-model-name tiny --max-model-len 512 --enforce-eager \
    --port "$ENGINE_PORT" --max-num-seqs 16 --max-num-active-seqs 8 \
    --control-plane-endpoint "$OUTPUT_RATE_ZMQ_ENDPOINT" --output-rate-engine-id demo-engine \
    >"$DEMO_DIR/engine.log" 2>&1 &
pids+=($!)
for _ in $(seq 240); do curl -fs "http://127.0.0.1:$ENGINE_PORT/v1/models" >/dev/null && break; sleep 1; done
get /engines

say "isolation: a tenant with 48 streams (3x the 16 resident slots) beside a normal user"
echo "first the tenant has no limit; then the operator moves it to the free tier over REST"
FOREVER=--forever
if [ "${DEMO_EXIT:-0}" = 1 ]; then FOREVER=; fi
"$PY" scripts/demo_client.py --url "http://127.0.0.1:$ENGINE_PORT" --control-plane "$CP" \
    --token "$OUTPUT_RATE_ADMIN_TOKEN" --tenant-streams 48 --tier free \
    --phase-seconds "${DEMO_PHASE_SECONDS:-15}" $FOREVER

say "usage as the engines report it"
get /usage

