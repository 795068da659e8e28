"""One Markdown table of a scripts/bench_gpu.sh run: `python scripts/bench_gpu_table.py OUT_DIR`.

Reads the JSON line each `bench step` printed (OUT_DIR/step_<precision>.txt; bf16-graph: --bf16 --cuda-graph), the last interval
line of the multi-rank run (train_tp2.txt) and the tests' summary (tests.txt), and prints the table
with the date, commit, device, driver and CuPy version it was measured with."""
import datetime
import json
import os
import subprocess
import sys

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "bf16-graph")


def last_json(path):
    """The last JSON line of a bench step's output, or None where it failed before printing one."""
    with open(path) as f:
        lines = [line for line in f if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def last_line(path, prefix):
    if not os.path.exists(path):
        return "not run"
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip().startswith(prefix)]
    return lines[-1] if lines else "no such line (see the file)"


def environment():
    """(commit, CuPy version, driver version) of this checkout and machine."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = (os.environ.get("BENCH_COMMIT")      # a copy of the tree without .git names its commit here
              or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True).stdout.strip() or "unknown")
    import cupy
    driver = cupy.cuda.runtime.driverGetVersion()
    return commit, cupy.__version__, f"{driver // 1000}.{driver % 1000 // 10}"


def torch_cell(result, name):
    peer = (result.get("torch") or {}).get(name)
    if peer is None:
        return "-"
    if "error" in peer:
        return "failed"
    return f"{peer['step_s'] * 1e3:.1f} ms ({peer['ours_over_theirs']:.2f}x)"


def row(precision, r):
    mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f} %"
    return (f"| {precision} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{r['ratio'] * 100:.1f} % | {r['peak_bytes'] / 2 ** 20:,.0f} MiB | {r['attention'].split(' (')[0]} | "
            f"{torch_cell(r, 'eager')} | {torch_cell(r, 'compile')} |")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "bench_gpu_out"
    results = {p: last_json(os.path.join(out, f"step_{p}.txt")) for p in PRECISIONS
               if os.path.exists(os.path.join(out, f"step_{p}.txt"))}
    if not results:
        raise SystemExit(f"{out} holds no step_<precision>.txt; run scripts/bench_gpu.sh first")
    if not any(results.values()):
        raise SystemExit(f"every bench step in {out} failed; its step_<precision>.txt files say why")
    first = next(r for r in results.values() if r)
    commit, cupy_version, driver = environment()
    print(f"{datetime.date.today()}, commit {commit}, {first['device_name']}, driver {driver}, CuPy {cupy_version}; "
          f"{first['num_layers']} x {first['hidden_size']}, {first['num_attention_heads']} heads, seq "
          f"{first['seq_length']}, vocab {first['vocab_size']}, micro-batch {first['micro_batch_size']}\n")
    print("| precision | step | tokens/s | MFU | of the GEMM ceiling | peak memory | attention "
          "| PyTorch eager (ours / theirs) | torch.compile (ours / theirs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for precision, result in results.items():
        print(row(precision, result) if result else f"| {precision} | failed: step_{precision}.txt says why |")
    print(f"\nGPU tests: {last_line(os.path.join(out, 'tests.txt'), '')}")
    print(f"2 ranks, TP 2, --bf16: {last_line(os.path.join(out, 'train_tp2.txt'), 'iter')}")


if __name__ == "__main__":
    main()
