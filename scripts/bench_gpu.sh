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
#   PRECISIONS    the bench step rows    (default: fp32 tf32 fp16 bf16 bf16-graph)
#   BENCH_TORCH   "none" leaves PyTorch out of the rows (each row's torch.compile takes the longest)
#   TEST_SECONDS  stop the GPU tests after this many seconds, their ranks too (default: no limit);
#                 on a lent machine with minutes of device time, the rows still get their turn
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench_gpu_out}"
mkdir -p "$out"
model="${BENCH_MODEL:---model gpt2-124m --micro-batch-size 8}"
iters="${BENCH_ITERS:---warmup 2 --iters 5}"
tests="${GPU_TESTS:-tests/test_kernels_gpu.py tests/test_gpu.py tests/comm/test_comm_gpu.py tests/test_fused_attention_and_graphs_gpu.py}"
precisions="${PRECISIONS:-fp32 tf32 fp16 bf16 bf16-graph}"
torch_flag=""; [ "${BENCH_TORCH:-}" = "none" ] && torch_flag="--no-torch"
train="${TRAIN_MODEL:---num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --micro-batch-size 4 --global-batch-size 4 --train-iters 20 --log-interval 10 --eval-interval 20 --eval-iters 1}"

if [ "$tests" != "none" ]; then
    echo "== GPU tests: $tests"
    # In a session of its own, so that a time limit stops the ranks the tests launched as well:
    # left running, they would share the GPU with the rows below. -v names each test as it ends,
    # so a stopped run still says which passed.
    # shellcheck disable=SC2086
    setsid --wait python -m pytest -v -p no:cacheprovider $tests > "$out/tests.txt" 2>&1 &
    pytest_pid=$!
    trap 'kill -TERM -- -"$pytest_pid" 2>/dev/null; exit 130' INT TERM
    if [ -n "${TEST_SECONDS:-}" ]; then
        # the watcher in a session of its own too, so that stopping it stops its sleep
        setsid bash -c 'sleep "$1"; echo "stopped after TEST_SECONDS=$1 s" >> "$2"
                        kill -TERM -- -"$3"; sleep 5; kill -KILL -- -"$3"' watcher \
            "$TEST_SECONDS" "$out/tests.txt" "$pytest_pid" < /dev/null > /dev/null 2>&1 &
        limit_pid=$!
    fi
    wait "$pytest_pid" || echo "the GPU tests failed or were stopped: $out/tests.txt says which"
    trap - INT TERM
    if [ -n "${limit_pid:-}" ]; then kill -- -"$limit_pid" 2>/dev/null || true; fi
    cat "$out/tests.txt"
fi
for precision in $precisions; do
    case "$precision" in fp32) flag="" ;; bf16-graph) flag="--bf16 --cuda-graph" ;; *) flag="--$precision" ;; esac
    echo "== bench step --device gpu $flag $model"
    # shellcheck disable=SC2086
    npmegatron bench step --device gpu $flag $model $iters $torch_flag 2>&1 | tee "$out/step_$precision.txt" ||
        echo "bench step --device gpu $flag failed: $out/step_$precision.txt says why"   # the table marks it
done
echo "== mpiexec -n 2 scripts/train.py --device gpu --tp 2 --bf16"
# shellcheck disable=SC2086
mpiexec -n 2 python scripts/train.py --device gpu --tp 2 --bf16 --attention-dropout 0 --hidden-dropout 0 \
    $train 2>&1 | tee "$out/train_tp2.txt" || echo "the 2-rank run failed: $out/train_tp2.txt says why"
python scripts/bench_gpu_table.py "$out" | tee "$out/table.md"
