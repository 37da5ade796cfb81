#!/usr/bin/env bash
# Everything that needs a GPU, on a machine with one (CUDA torch already installed there),
# in two parts that each fit one command of at most 10 minutes:
#   bash scripts/gpu_checks.sh first    # the gpu tests, the async checkpoint, the schedulers (~8 min)
#   bash scripts/gpu_checks.sh second   # the training step against a compiled plain loop, the fused head loss,
#                                       # one decoding step (~7 min)
#   bash scripts/gpu_checks.sh all 570  # both, in that order, within 570 s: each check's time limit is cut
#                                       # to what is left, and a check with under 40 s left is skipped
#   bash scripts/gpu_checks.sh second-first 570  # both, the training step's checks first
# Figures go to stdout and to $OUT (default /tmp/gpu-checks): one text file per check,
# JSON figures (fused_loss's at the end of gpu_step.txt), and decode_step's profile (operator
# tables in decode_step.txt, Chrome traces packed into one archive): 8 files, as many as a device run brings back.
# Packages such machines tend to lack (tomli-w; starlette, uvicorn, httptools and their few
# dependencies for the server tests): put their wheels in wheels/ (httptools' for the
# device's Python: `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 -d wheels httptools==0.9.0`), and those whose module
# is missing are installed from there without dependencies.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-first}"
# Counted from here: the installs below take part of the time too.
deadline=$(( $(date +%s) + ${2:-100000} ))
# Absolute: the tests start servers and ranks in other working directories.
export PYTHONPATH="${PYTHONPATH:-$PWD/src}"
out="${OUT:-/tmp/gpu-checks}"
mkdir -p "$out"
for pair in tomli_w:tomli_w starlette:starlette uvicorn:uvicorn h11:h11 httptools:httptools anyio:anyio click:click \
            prometheus_client:prometheus_client; do
    module="${pair%%:*}"; wheel="${pair##*:}"
    # pip picks the wheel that fits this Python (httptools' are per version: cp311, cp312).
    python3 -c "import $module" 2>/dev/null || python3 -m pip install -q --no-deps --no-index --find-links wheels "$wheel"
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# The time limit of a check: its own, or what is left before the deadline (less a margin for
# the rest of the script); 0 when under 40 s are left.
limit() {
    local left=$(( deadline - $(date +%s) - 10 ))
    if (( left < 40 )); then echo 0; elif (( left < $1 )); then echo "$left"; else echo "$1"; fi
}
skipped() { echo "   (skipped: under 40 s left before the deadline)"; }

first() {
    echo "== pytest -m gpu"
    # To a file, not a pipe: a server a failed test leaves behind would hold a pipe open. 300 s:
    # the tests of CUDA graphs, the fused loss and the profile window compile several runs more.
    t=$(limit 300); (( t )) || { skipped; return; }
    timeout -k 5 "$t" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu > "$out/pytest.txt" 2>&1
    tail -15 "$out/pytest.txt"
    echo "== benchmarks/checkpoint.py (gpt2-124m, one process; target: stall <= 0.05 of a synchronous save)"
    t=$(limit 170); (( t )) || { skipped; return; }
    timeout -k 5 "$t" python3 benchmarks/checkpoint.py --model gpt2-124m --nproc 1 --saves 3 > "$out/checkpoint.txt" 2>&1
    grep -v "[│┌└├]" "$out/checkpoint.txt" | tail -20
    echo "== benchmarks/inference.py part 3 on CUDA (continuous against request-level batching; target >= 2.5x)"
    t=$(limit 150); (( t )) || { skipped; return; }
    timeout -k 5 "$t" python3 benchmarks/inference.py --sections 3 --loads all-at-once --device cuda > "$out/inference.txt" 2>&1
    tail -8 "$out/inference.txt"
}

second() {
    # Tuned kernels (--tuned: a first compile twice as long) wait for a session with time to spare:
    # CUDA graphs go after the 1.8 ms of idle gaps the H100 profile showed in a 36 ms step.
    echo "== benchmarks/gpu_step.py (GPT-2 124M, bf16, batch 16 x 1024; meshyard plain, with the fused loss and with CUDA graphs, and the plain loop with CUDA graphs, against the plain loop)"
    t=$(limit 360); (( t )) || { skipped; return; }
    timeout -k 5 "$t" python3 benchmarks/gpu_step.py --rounds 1 --fused-loss --graphs --profile \
        --out "$out/gpu_step.json" > "$out/gpu_step.txt" 2>&1
    # The figures (the profile tables follow them in the file), or how the run ended without them.
    if grep -q "^round" "$out/gpu_step.txt"; then sed -n '/^round/,/^wrote/p' "$out/gpu_step.txt"; else tail -15 "$out/gpu_step.txt"; fi
    echo "== benchmarks/fused_loss.py (GPT-2's head and loss, 16 x 1024 tokens, bf16, compiled: train.fused_linear_loss)"
    t=$(limit 100); (( t )) || { skipped; return; }
    # Into gpu_step.txt, after its figures and tables: a device run brings back 8 files at most.
    echo "== benchmarks/fused_loss.py --compile" >> "$out/gpu_step.txt"
    timeout -k 5 "$t" python3 benchmarks/fused_loss.py --compile > "$out/fused.tmp" 2>&1
    tail -5 "$out/fused.tmp"
    cat "$out/fused.tmp" >> "$out/gpu_step.txt" && rm -f "$out/fused.tmp"
    echo "== benchmarks/decode_step.py (gpt2-124m, bf16, 128-token prompts; target: 16 rows <= 5 ms)"
    t=$(limit 90); (( t )) || { skipped; return; }
    mkdir -p "$out/decode"
    timeout -k 5 "$t" python3 benchmarks/decode_step.py --device cuda --rows 1,16 --steps 60 \
        --out "$out/decode_step.json" --profile "$out/decode/rows" > "$out/decode_step.txt" 2>&1
    grep "^rows" "$out/decode_step.txt"
    tar -czf "$out/decode_profile.tgz" -C "$out" decode && rm -rf "$out/decode"
}

case "$part" in
first) first ;;
second) second ;;
all) first; second ;;
second-first) second; first ;;
*)
    echo "unknown part '$part': give 'first', 'second', 'all [SECONDS]' or 'second-first [SECONDS]'" >&2
    exit 2
    ;;
esac
