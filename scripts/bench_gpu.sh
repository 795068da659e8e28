#!/usr/bin/env bash
# Everything a GPU machine should run, in one command, and one table of it:
#
#   scripts/bench_gpu.sh [OUT_DIR]          (default: bench_gpu_out/)
#
# 1. the GPU test files; 2. `npmegatron bench step --device gpu` at float32, --tf32, --fp16 and
# --bf16 on GPT-2 124M (and --bf16 --cuda-graph), each with PyTorch eager and torch.compile on the
# same GPU where torch is installed; 3. one multi-rank training run (2 ranks, TP 2, --bf16); 4. OUT_DIR/table.md with the
# date, commit, device, driver and CuPy version, also printed. Each step's output is kept in OUT_DIR.
#
# Environment (the slow test runs this on the strict CuPy stand-in with a small model):
#   BENCH_MODEL   bench step's model flags   (default: --model gpt2-124m --micro-batch-size 8)
#   BENCH_ITERS   bench step's timing flags  (default: --warmup 2 --iters 5)
#   GPU_TESTS     the test files             (default: the four GPU test files; "none" skips them)
#   TRAIN_MODEL   the multi-rank run's model flags (default: GPT-2 124M's layers on the embedded
#                 corpus, whose vocabulary is bytes; 20 iterations)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench_gpu_out}"
mkdir -p "$out"
model="${BENCH_MODEL:---model gpt2-124m --micro-batch-size 8}"
iters="${BENCH_ITERS:---warmup 2 --iters 5}"
tests="${GPU_TESTS:-tests/test_kernels_gpu.py tests/test_gpu.py tests/comm/test_comm_gpu.py tests/test_fused_attention_and_graphs_gpu.py}"
train="${TRAIN_MODEL:---num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --micro-batch-size 4 --global-batch-size 4 --train-iters 20 --log-interval 10 --eval-interval 20 --eval-iters 1}"

if [ "$tests" != "none" ]; then
    echo "== GPU tests: $tests"
    # shellcheck disable=SC2086
    python -m pytest -q -p no:cacheprovider $tests 2>&1 | tee "$out/tests.txt"
fi
for precision in fp32 tf32 fp16 bf16 bf16-graph; do
    case "$precision" in fp32) flag="" ;; bf16-graph) flag="--bf16 --cuda-graph" ;; *) flag="--$precision" ;; esac
    echo "== bench step --device gpu $flag $model"
    # shellcheck disable=SC2086
    npmegatron bench step --device gpu $flag $model $iters 2>&1 | tee "$out/step_$precision.txt" ||
        echo "bench step --device gpu $flag failed: $out/step_$precision.txt says why"   # the table marks it
done
echo "== mpiexec -n 2 scripts/train.py --device gpu --tp 2 --bf16"
# shellcheck disable=SC2086
mpiexec -n 2 python scripts/train.py --device gpu --tp 2 --bf16 --attention-dropout 0 --hidden-dropout 0 \
    $train 2>&1 | tee "$out/train_tp2.txt" || echo "the 2-rank run failed: $out/train_tp2.txt says why"
python scripts/bench_gpu_table.py "$out" | tee "$out/table.md"
