"""The one place a run is assembled: from a TrainConfig, the process grid, this rank's model
stages, the pipeline exchange, the data-parallel gradient buckets and the optimizer. The Trainer,
the benchmarks (`bench step`, `bench scaling`, `bench pipeline`), generation and the tests build
through here, so what is measured or tested is what trains."""
import dataclasses
from dataclasses import dataclass

from . import comm
from .config import RunPlan, TrainConfig
from .data_parallel import GradientBuckets
from .data_parallel.expert_parallel import (ExpertParallelAdamW, ExpertParallelBuckets,
                                            ExpertParallelDistributedAdamW)
from .data_parallel.distributed_optimizer import DistributedAdamW, ShardedGradientBuckets
from .optim.adamw import AdamW
from .pipeline import PipelineModel, StageExchange
from .pipeline_layout import default_layout, parse_layout, plan_stages


@dataclass
class Run:
    """What a training step needs on this rank (training/step.py's train_step takes its parts)."""
    config: TrainConfig
    plan: RunPlan
    grid: object                # comm.ProcessGrid
    cfg: object                 # the model's GPTConfig (its vocabulary the data's)
    model: PipelineModel
    schedule: str               # 1f1b, afab or interleaved
    exchange: StageExchange
    params: list
    buckets: GradientBuckets
    optimizer: AdamW
    norm_skip: object           # what counts once in the global gradient norm


def assemble(config: TrainConfig, vocab_size=None, world_size=None):
    """The Run of `config` on the ranks mpirun started (`world_size` ranks; one without mpirun),
    with the model's vocabulary set to `vocab_size` when given (the training data's)."""
    plan = config.plan(comm.launch_size() if world_size is None else world_size)
    grid = build_grid(plan.tp, plan.pp, nccl=config.model.device == "gpu", cp=plan.cp, ep=plan.ep,
                      etp=plan.etp)
    cfg = config.model if vocab_size is None else dataclasses.replace(config.model, vocab_size=vocab_size)
    model = build_model(cfg, grid, plan.layout)
    schedule = config.parallel.pipeline_schedule or ("interleaved" if model.virtual_size > 1 else "1f1b")
    exchange = StageExchange(grid, cfg.dtype, model.xp, plan.micro_batches, config.parallel.variable_seq_lengths)
    params = model.parameters()
    buckets, optimizer = build_optimizer(model, params, grid, config)
    return Run(config, plan, grid, cfg, model, schedule, exchange, params, buckets, optimizer, model.norm_skip())


def build_grid(tp=1, pp=1, nccl=False, cp=1, ep=1, etp=None):
    """A grid of TP x CP x PP x DP ranks under mpirun (DP = world / (TP x CP x PP)), the experts
    split over EP of the DP x CP ranks and each over ETP (TP or 1) ranks; one rank without it. `nccl`: a GPU run, whose NCCL communicators
    are all made here (ProcessGrid.connect_nccl)."""
    if not comm.launched_by_mpi():
        return comm.ProcessGrid.single()
    comm.init()
    return comm.ProcessGrid(tp=tp, pp=pp, nccl=nccl, cp=cp, ep=ep, etp=etp)


def build_model(cfg, grid, layout=None):
    """The stages of `layout` (Megatron's layout string; default: the layers split evenly over
    the pipeline ranks) that this rank holds, as one model."""
    layout = layout or default_layout(cfg.num_layers, grid.pp_size)
    return PipelineModel(cfg, grid, plan_stages(parse_layout(layout), cfg.num_layers, grid.pp_size, layout))


def expert_parameter_ids(model):
    """The ids of the routed experts' parameters, which EP shards and its optimizer keeps apart."""
    return {id(p) for _, p, spec in model.named_specs() if spec.expert}


def build_optimizer(model, params, grid, config):
    """(gradient buckets, optimizer): AdamW over DP all-reduced buckets, or with
    --use-distributed-optimizer each DP rank's share of AdamW over reduce-scattered buckets."""
    bucket_size = config.parallel.ddp_bucket_size
    storage = config.model.storage_format     # --fp16/--bf16: float32 master weights
    settings = {"lr": config.lr, "betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_eps,
                "weight_decay": config.weight_decay, "storage": storage}
    sharded = config.parallel.use_distributed_optimizer
    tied = getattr(model, "tied", None)
    if grid.ep_size > 1:
        experts = expert_parameter_ids(model)
        buckets = ExpertParallelBuckets(params, experts, grid, bucket_size, storage, sharded,
                                        alone=[tied.weight] if tied and sharded else [])
        if sharded:
            return buckets, ExpertParallelDistributedAdamW(params, buckets, grid, **settings)
        return buckets, ExpertParallelAdamW(params, experts, **settings)
    if not sharded:
        # averaged over DP and CP together: a CP rank's gradient is that of its tokens' mean loss
        buckets = GradientBuckets(params, grid.dp_cp_group, bucket_size, storage=storage)
        return buckets, AdamW(params, layout=buckets.layout, **settings)
    buckets = ShardedGradientBuckets(params, grid.dp_cp_group, bucket_size, alone=[tied.weight] if tied else [],
                                     storage=storage)
    return buckets, DistributedAdamW(buckets, **settings)
