#!/usr/bin/env bash
# The CUDA check, one command on a machine whose python3 has a CUDA build of torch:
#
#     bash scripts/gpu_check.sh
#
# No downloads (random-initialised weights); about 7 minutes on one H200.
#  1. The CUDA test tier (pytest -m cuda): the sink cache against the paper-style reference on
#     CUDA with streamchat's attention (SDPA, decode queries packed per KV head), eager and
#     compiled (CUDA graphs); the compiled decode step's graph reading each KV head once; a
#     20-turn session with evictions and /regen, compiled against eager.
#  2. One decode query's attention (scripts/decode_attention_figures.py): seconds.
#  3. Decode speed of Llama-2-7B shapes in bfloat16 at a full 4+2000 cache: streamchat with
#     compile off and on, transformers' generate() with a compiled StaticCache, and the
#     memory-bandwidth limit, in one table (streamchat bench decode).
#  4. The engine's step with 1 and 8 conversations, Llama-2-7B shapes in bfloat16: decode rows fed
#     together and prompts read together, against one (scripts/engine_scaling_figures.py): the
#     serving ratios (8 conversations' throughput, the last first token's wait) without the server.
#
# Python packages the machine lacks (streamchat's own dependencies, at the versions
# pyproject.toml pins) can be put as wheels in .whl/: they are installed into a
# temporary folder first, nothing is fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/streamchat-site .whl/*.whl
    export PYTHONPATH=/tmp/streamchat-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA GPU here")'
"$PYTHON" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__)'

echo "== 1. CUDA test tier"
"$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -p no:xdist tests

echo "== 2. one decode query's attention over 2005 slots: repeat_kv against packed heads, eager and compiled"
"$PYTHON" scripts/decode_attention_figures.py --device cuda

echo "== 3. decode speed, Llama-2-7B shapes, bfloat16, cache 4+2000 full"
"$PYTHON" -m streamchat bench decode --random-init llama-2-7b --device cuda --dtype bfloat16 --quantize none \
    --window 2000 --full-cache --trials 3 --out "${OUT:-bench-results}/gpu-check"

echo "== 4. the engine's step with 1 and 8 conversations, Llama-2-7B shapes, bfloat16"
"$PYTHON" scripts/engine_scaling_figures.py --random-init llama-2-7b --device cuda --dtype bfloat16 --quantize none \
    --rows 1,8 --rounds 3
