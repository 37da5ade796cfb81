#!/usr/bin/env bash
# Everything that needs a GPU, in one run on a machine with one (CUDA torch already
# installed there): the gpu tests, the training step against a compiled plain loop, one
# decoding step of the server against its matrix work, the async checkpoint's stall.
# Figures go to stdout and to $OUT (default /tmp/gpu-checks); decode_step's profile (operator
# tables in decode_step.txt, Chrome traces) too.
#   bash scripts/gpu_checks.sh
# tomli-w is the one dependency such machines tend to lack: put its wheel in wheels/.
set -uo pipefail
cd "$(dirname "$0")/.."
# Absolute: the tests start servers and ranks in other working directories.
export PYTHONPATH="${PYTHONPATH:-$PWD/src}"
out="${OUT:-/tmp/gpu-checks}"
mkdir -p "$out"
python3 -c "import tomli_w" 2>/dev/null || python3 -m pip install -q --no-deps wheels/tomli_w-*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# The parts most in question first: a run cut short by its time limit still answers them.
echo "== benchmarks/decode_step.py (gpt2-124m, bf16, 128-token prompts; target: 16 rows <= 5 ms)"
timeout -k 5 120 python3 benchmarks/decode_step.py --device cuda --steps 100 --out "$out/decode_step.json" --profile "$out/decode" \
    > "$out/decode_step.txt" 2>&1
grep "^rows" "$out/decode_step.txt"
echo "== pytest -m gpu"
# To a file, not a pipe: a server a failed test leaves behind would hold a pipe open.
timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu > "$out/pytest.txt" 2>&1
tail -15 "$out/pytest.txt"
echo "== benchmarks/checkpoint.py (gpt2-124m, one process)"
timeout -k 5 200 python3 benchmarks/checkpoint.py --model gpt2-124m --nproc 1 --saves 3 > "$out/checkpoint.txt" 2>&1
grep -v "[│┌└├]" "$out/checkpoint.txt" | tail -20
echo "== benchmarks/inference.py part 3 on CUDA (continuous against request-level batching; target >= 2.5x)"
timeout -k 5 200 python3 benchmarks/inference.py --sections 3 --loads all-at-once --device cuda > "$out/inference.txt" 2>&1
tail -8 "$out/inference.txt"
echo "== benchmarks/gpu_step.py (GPT-2 124M, bf16, batch 16 x 1024; none and fsdp against the plain loop)"
timeout -k 5 300 python3 benchmarks/gpu_step.py --rounds 2 --fsdp --out "$out/gpu_step.json" 2>&1 | tail -25
cp "$out/gpu_step.json" "benchmarks/results/gpu-$(date +%F).json" 2>/dev/null
