"""`npmegatron plan --against results.jsonl`: the plan's step time for every run `bench scaling`
recorded, beside the measured one. The records name the model, layout, batch, dropout, sequence
parallelism and threads per rank; the rest is GPTConfig's defaults. A record written before the
dropout was recorded is of a run without dropout, as the benchmarks train."""
import json

from ...autograd import InputError
from ...config import GPTConfig
from ...perf import ParallelShape
from ...perf.time_model import step_time

COUNTS = ("tp", "pp", "dp", "global_batch", "micro_batch", "seq", "num_layers", "hidden_size",
          "num_attention_heads", "vocab_size")
RECORD_FIELDS = ("layout",) + COUNTS + ("dtype", "step_s")


def read_records(path):
    """The JSON lines of a bench scaling results.jsonl, each checked for the fields used here."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        records = [json.loads(line) for line in lines]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"--against {path} is not a readable results.jsonl of `npmegatron bench scaling` "
                         f"({error}); give the file that command wrote") from None
    for number, record in enumerate(records, 1):
        missing = [k for k in RECORD_FIELDS if not isinstance(record, dict) or k not in record]
        if missing:
            raise InputError(f"--against {path} line {number} lacks {', '.join(missing)}; give a results.jsonl "
                             "written by `npmegatron bench scaling`")
        wrong = [k for k in COUNTS if isinstance(record[k], bool) or not isinstance(record[k], int)
                 or not 1 <= record[k] <= (2 ** 16 if k in ("tp", "pp", "dp") else 2 ** 31)]
        step = record["step_s"]
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step < float("inf"):
            wrong.append("step_s")
        if record["dtype"] not in ("float32", "float64"):
            wrong.append("dtype")
        if wrong:
            raise InputError(f"--against {path} line {number} has {', '.join(f'{k} = {record[k]!r}' for k in wrong)}, "
                             "of the wrong type or out of range; give a results.jsonl written by "
                             "`npmegatron bench scaling`")
    if not records:
        raise InputError(f"--against {path} holds no records; give a results.jsonl of `npmegatron bench scaling`")
    return records


def predicted_against_measured(records, profile):
    """[{layout, model, predicted_s, measured_s, error}] with error = predicted / measured - 1."""
    rows = []
    for r in records:
        cfg = GPTConfig(num_layers=r["num_layers"], hidden_size=r["hidden_size"], vocab_size=r["vocab_size"],
                        num_attention_heads=r["num_attention_heads"], dtype=r["dtype"],
                        sequence_parallel=r.get("sequence_parallel") is True, max_position_embeddings=r["seq"],
                        **{k: float(r[k]) if _share(r.get(k)) else 0.0 for k in ("hidden_dropout", "attention_dropout")})
        threads = r.get("threads_per_rank")
        shape = ParallelShape(tp=r["tp"], pp=r["pp"], dp=r["dp"], micro_batch=r["micro_batch"],
                              global_batch=r["global_batch"], seq=r["seq"], sequence_parallel=cfg.sequence_parallel,
                              threads_per_rank=threads if isinstance(threads, int) and threads >= 1 else None)
        predicted = step_time(cfg, shape, profile)
        rows.append({"layout": r["layout"], "model": f"{r['num_layers']}x{r['hidden_size']} seq {r['seq']} "
                     f"mb {r['micro_batch']} vocab {r['vocab_size']}", "predicted_s": predicted["total"],
                     "measured_s": r["step_s"], "error": predicted["total"] / r["step_s"] - 1,
                     "terms": {k: v for k, v in predicted.items() if k not in ("model_flops", "flops_per_device",
                                                                              "samples_per_s")}})
    return rows


def _share(value):
    """A dropout probability as a record holds it."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1


def format_against(rows):
    lines = [f"{'model':<36}{'layout':>8}{'predicted s':>13}{'measured s':>12}{'error':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<36}{r['layout']:>8}{r['predicted_s']:>13.3f}{r['measured_s']:>12.3f}"
                     f"{r['error'] * 100:>8.1f}%")
    return "\n".join(lines)
