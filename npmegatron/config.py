"""The one source of a run's configuration: the model (GPTConfig), the parallel layout
(ParallelConfig) and the training run (TrainConfig, which nests the other two), each field with
its default, its help and its check written once. `train`'s flags are generated from these fields
(cli_support.config_options), so a new training flag is a new field here and nowhere else; bench,
plan and generate take the fields they share with training from here too, and declare beside
their commands only what is theirs (generate's sampling, the benchmarks' timing, plan's machine
profile and its own `--recompute none|selective|full`). Flags are Megatron-LM's names.

`TrainConfig.plan(world_size)` turns a configuration into the run's shape (DP size, micro-batches
per step, pipeline layout and schedule): every check that needs the number of ranks is there.
"""
import ast
import dataclasses
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional

from .autograd import InputError
from .data import parse_split
from .pipeline_layout import default_layout, parse_layout
from .recompute import recompute_segments


def option(default, help, *, aliases=(), choices=None, minimum=None, negatable=False):
    """A configuration field that is also a command-line option `--field-name` (plus `aliases`);
    `minimum` (1: a count, 0: a non-negative amount) is checked by `check_minimums`."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices,
                                            "minimum": minimum, "negatable": negatable})


def check_minimums(config):
    """Every field with a minimum holds a finite value at least that (None: not given)."""
    for spec in fields(config):
        check_minimum(spec, getattr(config, spec.name))


def check_given(options, *config_classes):
    """The minimums of `options` (a command's, by field name) that are fields of config_classes:
    for a command that takes a few of a config's flags without building that config."""
    for config_class in config_classes:
        for spec in fields(config_class):
            if spec.name in options:
                check_minimum(spec, options[spec.name])


def check_minimum(spec, value):
    minimum = spec.metadata.get("minimum")
    if minimum is None or value is None:
        return
    if not (value >= minimum and math.isfinite(value)):
        rule = "a positive integer" if minimum == 1 else "a finite number, not negative"
        raise InputError(f"{spec.name} is {value}; it must be {rule}")


#: What --model-family sets, for each part whose own flag is not given.
MODEL_FAMILIES = {
    "gpt2": {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
             "untie_embeddings_and_output_weights": False, "disable_bias_linear": False},
    "llama": {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
              "untie_embeddings_and_output_weights": True, "disable_bias_linear": True},
}


def default_ffn_hidden_size(hidden_size, swiglu):
    """4 x hidden for GeLU; for SwiGLU, whose first layer is twice as wide, 2/3 of that rounded down
    to a multiple of 64 as Megatron-LM does (exactly 8/3 x hidden for models too small for that)."""
    if not swiglu:
        return 4 * hidden_size
    return int(8 * hidden_size / 3 / 64) * 64 or max(1, int(8 * hidden_size / 3))


@dataclass
class GPTConfig:
    """GPT-2's shape and numerics; with a TP group of one rank the model is the serial one."""
    num_layers: int = option(4, "Transformer layers.", minimum=1)
    hidden_size: int = option(128, "Hidden (embedding) size.", minimum=1)
    num_attention_heads: int = option(4, "Attention heads; must divide --hidden-size.", minimum=1)
    vocab_size: int = option(256, "Vocabulary size.", minimum=1)
    max_position_embeddings: int = option(256, "Length of the learned position table (train: default "
                                               "--seq-length).", minimum=1)
    ffn_hidden_size: Optional[int] = option(None, "The MLP's inner size (default: 4 x --hidden-size, as GPT-2).",
                                            minimum=1)
    model_family: str = option("gpt2", "Defaults for the block's parts: gpt2 (LayerNorm, learned positions, "
                                       "GeLU, biases, the output layer tied to the embedding) or llama "
                                       "(RMSNorm, rotary positions, SwiGLU, no biases, an untied output "
                                       "layer); each part's own flag overrides it.", choices=MODEL_FAMILIES)
    normalization: Optional[str] = option(None, "LayerNorm or RMSNorm (default: the model family's).",
                                          choices=("LayerNorm", "RMSNorm"))
    position_embedding_type: Optional[str] = option(
        None, "learned_absolute (a trained position table) or rope (rotary embeddings of queries and keys; "
              "default: the model family's).", choices=("learned_absolute", "rope"))
    rotary_base: float = option(10000.0, "Rotary embeddings: the base of the angles' frequencies (HF's "
                                         "rope_theta).", minimum=1)
    rotary_percent: float = option(1.0, "Rotary embeddings: the fraction of each head's channels rotated.",
                                   minimum=0)
    swiglu: Optional[bool] = option(None, "SwiGLU MLP: silu(x W_gate) * (x W_up), then the down projection "
                                          "(default: the model family's).", negatable=True)
    group_query_attention: bool = option(False, "Grouped-query attention: --num-query-groups key/value heads, "
                                                "each shared by a group of query heads.")
    num_query_groups: Optional[int] = option(None, "Key/value heads under --group-query-attention (must "
                                                   "divide the attention heads, and be divisible by TP).",
                                             minimum=1)
    untie_embeddings_and_output_weights: Optional[bool] = option(
        None, "An output layer of its own instead of the word embedding's transpose (default: the model "
              "family's).", negatable=True)
    disable_bias_linear: Optional[bool] = option(None, "No biases in the linear layers (default: the model "
                                                       "family's).", negatable=True)
    add_qkv_bias: bool = option(False, "A bias on the QKV projection even where --disable-bias-linear leaves the "
                                       "other linear layers without one (Qwen2, Qwen2-MoE).")
    hidden_dropout: float = option(0.1, "Dropout on embeddings and residual branches.")
    attention_dropout: float = option(0.1, "Dropout on attention probabilities.")
    layernorm_epsilon: float = 1e-5
    init_method_std: float = option(0.02, "Standard deviation of the weights' normal initialisation "
                                          "(paper §4.2; output layers' divided by sqrt(2 x layers)).", minimum=0)
    gelu: str = "tanh"                     # GPT-2's approximation; 'none' for exact erf
    sequence_parallel: bool = option(False, "LayerNorm and dropout on sequence shards.")
    recompute_granularity: Optional[str] = option(
        None, "Activation recomputation. full: a layer keeps only its input and runs again in backward; "
              "selective: only the attention core, which blockwise attention always recomputes.",
        choices=("full", "selective"))
    recompute_method: Optional[str] = option(
        None, "With full: uniform (every chunk of --recompute-num-layers layers keeps only its input; "
              "the default) or block (the first --recompute-num-layers layers of each stage).",
        choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = option(
        None, "With full: layers per recomputed chunk (uniform) or recomputed layers per stage "
              "(block); default 1.", minimum=1)
    make_vocab_size_divisible_by: int = 128  # padding unit, times the TP size
    dtype: str = option("float32", "Parameter and activation precision.", choices=("float32", "float64"))
    fp16: bool = option(False, "Mixed precision: parameters, activations and their gradients on the "
                               "float16 grid, float32 arithmetic and master weights, dynamic loss scaling.")
    bf16: bool = option(False, "Mixed precision with bfloat16 values (no loss scaling unless --loss-scale).")
    device: str = option("cpu", "NumPy on the CPU or CuPy on the GPU.", choices=("cpu", "gpu"))
    tf32: bool = option(False, "TF32 tensor cores for float32 matmuls (GPU, float32 only).")
    seed: int = option(1234, "Seed of weights, data and dropout.", minimum=0)
    # Mixture of experts (npmegatron/moe/), Megatron-Core's flags
    num_experts: Optional[int] = option(None, "Experts in each MoE layer (none: every layer's MLP is dense).",
                                        minimum=1)
    moe_layer_freq: str = option("1", "Which layers are MoE: every N-th (an integer N, layer 0 first) or a "
                                      "pattern of one 0/1 per layer, e.g. '([0]*1+[1]*3)'.")
    moe_ffn_hidden_size: Optional[int] = option(None, "Each expert's inner size (default: --ffn-hidden-size).",
                                                minimum=1)
    moe_router_topk: int = option(2, "Experts each token goes to.", minimum=1)
    moe_router_score_function: str = option("softmax", "softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3).",
                                            choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = option(False, "Softmax over all experts before the top k (the weights are "
                                                 "then not renormalised over the k).")
    moe_router_topk_scaling_factor: Optional[float] = option(None, "Multiplies the routing weights.", minimum=0)
    moe_router_num_groups: Optional[int] = option(None, "Group-limited routing: expert groups.", minimum=1)
    moe_router_group_topk: Optional[int] = option(None, "Group-limited routing: groups each token may use.",
                                                  minimum=1)
    moe_router_load_balancing_type: str = option("aux_loss", "aux_loss (over the micro-batch's tokens), "
                                                             "seq_aux_loss (per sequence) or none.",
                                                 choices=("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = option(0.0, "Coefficient of the load-balancing loss.", minimum=0)
    moe_z_loss_coeff: Optional[float] = option(None, "Coefficient of the router's z-loss.", minimum=0)
    moe_router_enable_expert_bias: bool = option(False, "Auxiliary-loss-free balancing (DeepSeek-V3): a bias "
                                                        "on each expert's score for choosing, updated each step.")
    moe_router_bias_update_rate: float = option(1e-3, "How far the expert bias moves a step.", minimum=0)
    moe_shared_expert_intermediate_size: Optional[int] = option(
        None, "A shared expert of this inner size that every token goes through.", minimum=1)
    moe_shared_expert_gate: bool = option(False, "Gate the shared expert's output by sigmoid(x w) (Qwen2-MoE).")
    moe_expert_capacity_factor: Optional[float] = option(
        None, "Each expert takes at most this factor times its even share of the micro-batch's k T choices; "
              "the rest are dropped (none: dropless).")
    moe_token_drop_policy: str = option("probs", "Which choices an expert over capacity keeps: its highest "
                                                 "router weights (probs) or its earliest tokens (position).",
                                        choices=("probs", "position"))
    moe_router_dtype: Optional[str] = option(None, "Compute the router (logits, weights, losses) in this dtype, "
                                                   "unrounded under --fp16/--bf16 (default: the model's).",
                                             choices=("fp32", "fp64"))
    moe_pad_expert_input_to_capacity: bool = option(False, "Pad every expert's rows to its capacity (static "
                                                           "shapes; the numbers do not change).")

    def __post_init__(self):
        if self.model_family not in MODEL_FAMILIES:
            raise InputError(f"model family {self.model_family!r} is not known; use one of "
                             f"{', '.join(MODEL_FAMILIES)}")
        for name, value in MODEL_FAMILIES[self.model_family].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
        if self.num_query_groups is None or not self.group_query_attention:
            self.num_query_groups = self.num_attention_heads if self.num_query_groups is None else self.num_query_groups
        check_minimums(self)
        if self.ffn_hidden_size < 1:
            raise InputError(f"ffn_hidden_size is {self.ffn_hidden_size}; it must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise InputError(f"hidden size {self.hidden_size} is not divisible by "
                             f"{self.num_attention_heads} attention heads; choose a hidden size that "
                             "is a multiple of the number of heads")
        self._check_family_parts()
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InputError(f"{name} is {getattr(self, name)}; it must be in [0, 1)")
        if self.dtype not in ("float32", "float64"):
            raise InputError(f"dtype {self.dtype!r} is not supported; use float32 or float64")
        if self.device not in ("cpu", "gpu"):
            raise InputError(f"device {self.device!r} is not supported; use cpu or gpu")
        self._check_recompute()
        self._check_mixed_precision()
        self._check_moe()
        if self.tf32 and (self.device, self.dtype) != ("gpu", "float32"):
            raise InputError(f"tf32 is for float32 matmuls on the GPU, but this run has device "
                             f"{self.device} and dtype {self.dtype}; drop --tf32 or use --device gpu "
                             "--dtype float32")

    def _check_family_parts(self):
        if self.group_query_attention and self.num_attention_heads % self.num_query_groups:
            raise InputError(f"--num-query-groups {self.num_query_groups} does not divide the "
                             f"{self.num_attention_heads} attention heads; choose a divisor of them")
        if not self.group_query_attention and self.num_query_groups != self.num_attention_heads:
            raise InputError(f"--num-query-groups {self.num_query_groups} needs --group-query-attention; "
                             "add it or drop --num-query-groups")
        if not 0 < self.rotary_percent <= 1:
            raise InputError(f"--rotary-percent is {self.rotary_percent}; it must be in (0, 1]")
        if self.position_embedding_type == "rope" and self.rotary_dim < 2:
            raise InputError(f"--rotary-percent {self.rotary_percent} of a head of {self.head_dim} channels "
                             "rotates fewer than 2; raise it")

    @property
    def rotary_dim(self):
        """Channels of each head that rotary embeddings turn: an even number (pairs)."""
        return int(self.head_dim * self.rotary_percent) // 2 * 2

    @property
    def query_groups_size(self):
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def add_bias_linear(self):
        return not self.disable_bias_linear

    @property
    def qkv_bias(self):
        """Whether the QKV projection has a bias: with every linear layer's, or alone (--add-qkv-bias)."""
        return self.add_bias_linear or self.add_qkv_bias

    def _check_recompute(self):
        if self.recompute_granularity not in (None, "full", "selective"):
            raise InputError(f"recompute granularity {self.recompute_granularity!r} is not known; use "
                             "full or selective")
        if self.recompute_method not in (None, "uniform", "block"):
            raise InputError(f"recompute method {self.recompute_method!r} is not known; use uniform or block")
        chosen = [name for name in ("recompute_method", "recompute_num_layers") if getattr(self, name) is not None]
        if chosen and self.recompute_granularity != "full":
            flag = "--" + chosen[0].replace("_", "-")
            raise InputError(f"{flag} chooses the layers of full recomputation, but recompute "
                             f"granularity is {self.recompute_granularity or 'not set'}; add "
                             f"--recompute-granularity full or drop {flag}")

    def _check_mixed_precision(self):
        if self.fp16 and self.bf16:
            raise InputError("--fp16 and --bf16 were both given; choose one 16-bit format")
        if self.storage_format and self.dtype != "float32":
            raise InputError(f"--{self.storage_format} computes in float32 on 16-bit values, but dtype "
                             f"is {self.dtype}; drop --dtype {self.dtype} or drop --{self.storage_format}")

    def _check_moe(self):
        if self.num_experts is None:
            given = [name for name in ("moe_shared_expert_intermediate_size", "moe_ffn_hidden_size")
                     if getattr(self, name) is not None]
            if given or self.moe_shared_expert_gate or self.moe_router_enable_expert_bias:
                flag = "--" + (given[0] if given else "moe_shared_expert_gate").replace("_", "-")
                raise InputError(f"{flag} configures mixture-of-experts layers, but --num-experts is not "
                                 "given; add --num-experts or drop it")
            return
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.moe_router_topk > self.num_experts:
            raise InputError(f"--moe-router-topk {self.moe_router_topk} is more than the {self.num_experts} "
                             "experts; choose at most --num-experts")
        self.moe_layers = parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise InputError("group-limited routing needs both --moe-router-num-groups and "
                             "--moe-router-group-topk; give both or neither")
        if groups and (self.num_experts % groups or group_topk > groups or self.moe_router_topk % group_topk
                       or self.moe_router_topk // group_topk > self.num_experts // groups):
            raise InputError(f"--moe-router-num-groups {groups} must divide the {self.num_experts} experts and "
                             f"--moe-router-group-topk {group_topk} must be at most the groups and divide "
                             f"--moe-router-topk {self.moe_router_topk} into shares a group can give; choose "
                             "such values")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise InputError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                             "(DeepSeek-V3's routing), as Megatron-Core; add it or drop the expert bias")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise InputError(f"--moe-expert-capacity-factor is {self.moe_expert_capacity_factor}; it must be "
                             "positive (or left out for dropless MoE layers)")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise InputError("--moe-pad-expert-input-to-capacity pads to a capacity, but "
                             "--moe-expert-capacity-factor is not given; add it or drop the padding")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise InputError("--moe-shared-expert-gate gates a shared expert, but "
                             "--moe-shared-expert-intermediate-size is not given; add it or drop the gate")

    def is_moe_layer(self, layer):
        """Whether layer number `layer` (from 0) has experts in place of its MLP."""
        return self.num_experts is not None and bool(self.moe_layers[layer])

    @property
    def storage_format(self):
        """'fp16' or 'bf16' under mixed precision (autograd/precision.py), else None."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else None

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


def parse_moe_layer_freq(freq, num_layers):
    """--moe-layer-freq as one 0/1 per layer: an integer N (layers 0, N, 2N, ... are MoE) or
    Megatron's pattern, a Python list expression of 0s and 1s such as "([0]*1+[1]*3)", read
    without eval: only lists of 0 and 1, +, * by an integer and parentheses."""
    text = str(freq).strip()
    if text.isdigit():
        every = int(text)
        if every < 1:
            raise InputError(f"--moe-layer-freq {freq} must be a positive integer or a pattern such as "
                             "'([0]*1+[1]*3)'")
        return [int(i % every == 0) for i in range(num_layers)]
    pattern = _pattern_value(text, freq)
    if len(pattern) != num_layers:
        raise InputError(f"--moe-layer-freq {freq} gives {len(pattern)} layers, but the model has "
                         f"{num_layers}; give one 0 or 1 per layer")
    return pattern


def _pattern_value(text, freq):
    bad = InputError(f"--moe-layer-freq {freq!r} is neither an integer nor a list pattern of 0s and 1s "
                     "such as '([0]*1+[1]*3)'")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise bad from None

    def value(node):
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts):
            return [int(e.value) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                return left * right
        raise bad

    result = value(tree)
    if not isinstance(result, list):
        raise bad
    return result


def check_expert_parallel(config, ep, dp, cp=1):
    """Expert parallelism's conditions, each refused in one sentence: EP takes its ranks from the
    DP x CP ranks (Megatron-Core's expert grid)."""
    model, parallel = config.model, config.parallel
    refusals = [
        (model.num_experts is None, "it splits MoE layers' experts, but --num-experts is not given; add it"),
        (model.num_experts is not None and model.num_experts % ep,
         f"the {model.num_experts} experts do not split evenly over {ep} ranks; choose a divisor of them"),
        ((dp * cp) % ep, f"its ranks come from the {dp * cp} data-parallel" + (" x context-parallel" if cp > 1
                         else "") + f" ranks, which {ep} does not divide; launch a multiple of it"),
    ]
    why = next((reason for refused, reason in refusals if refused), None)
    if why:
        raise InputError(f"--expert-model-parallel-size {ep} cannot be used here: {why}")


def check_expert_tensor_parallel(config, tp):
    """The experts' tensor-parallel size: --tp unless --expert-tensor-parallel-size says 1."""
    etp = config.parallel.expert_tensor_parallel_size
    if etp is None or etp == tp:
        return tp
    if config.model.num_experts is None:
        raise InputError(f"--expert-tensor-parallel-size {etp} splits MoE layers' experts, but --num-experts "
                         "is not given; add it or drop the flag")
    if etp != 1:
        raise InputError(f"--expert-tensor-parallel-size {etp} is neither 1 nor --tp {tp}: splitting experts "
                         "over a TP size of their own (Megatron's parallel folding) is not built; choose 1 or "
                         f"{tp}")
    return etp


# Context parallelism's conditions (context_parallel/split.py splits the sequence).

def check_context_parallel_split(seq_length, cp_size):
    if seq_length % (2 * cp_size):
        raise InputError(f"sequence length {seq_length} is not divisible by 2 x context-parallel size "
                         f"{cp_size} = {2 * cp_size}, as the balanced causal split needs; use a multiple "
                         f"of {2 * cp_size}")


def check_context_parallel_dropout(cfg, cp_size):
    """Context parallelism runs without dropout: ring attention draws no masks, and the masks of
    the other layers are keyed by their shape and place in the model, not by token positions, so
    the CP ranks would drop the same entries of different tokens."""
    for name in ("hidden_dropout", "attention_dropout"):
        if getattr(cfg, name) > 0:
            flag = "--" + name.replace("_", "-")
            raise InputError(f"--cp {cp_size} runs without dropout, but {flag} is {getattr(cfg, name)}; "
                             f"pass {flag} 0")


@dataclass
class ParallelConfig:
    """How the ranks split the work: rank = tp + TP * (cp + CP * (dp + DP * pp)), DP = world / (TP * CP * PP)."""
    tensor_model_parallel_size: int = option(1, "Tensor-parallel ranks (launch with mpirun -n TP).",
                                             aliases=("--tp",), minimum=1)
    pipeline_model_parallel_size: int = option(1, "Pipeline stages (ranks = TP x CP x PP x DP).",
                                               aliases=("--pp",), minimum=1)
    context_parallel_size: int = option(1, "Context-parallel ranks: each sample's sequence split over them "
                                           "(two chunks each, balanced for causal attention), attention as "
                                           "ring attention.", aliases=("--cp",), minimum=1)
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "Layers per virtual stage: interleaved schedule with num-layers / (PP x this) stages per rank.",
        minimum=1)
    pipeline_model_parallel_layout: Optional[str] = option(
        None, "Stages as a string, e.g. 'Et*3|(tt|)*4,tL' (E embedding, t layer, L loss, | stage).")
    pipeline_schedule: Optional[str] = option(None, "Default: 1f1b, or interleaved with virtual stages.",
                                              choices=("1f1b", "afab", "interleaved"))
    num_micro_batches: Optional[int] = option(
        None, "Micro-batches per step on each DP rank (default: from --global-batch-size).", minimum=1)
    deallocate_pipeline_outputs: bool = option(True, "Free a stage's output data once it is sent.",
                                               negatable=True)
    variable_seq_lengths: bool = option(False, "Exchange shapes before each activation.")
    overlap_p2p_communication: bool = option(True, "Post the next receive before the current compute.",
                                             negatable=True)
    ddp_bucket_size: int = option(2 ** 20, "Parameters per data-parallel gradient all-reduce.", minimum=1)
    use_distributed_optimizer: bool = option(
        False, "Shard AdamW's state over the data-parallel ranks (ZeRO-1): gradients reduce-scattered, "
               "parameters all-gathered after the step.")
    expert_model_parallel_size: int = option(
        1, "Expert parallelism: the MoE layers' experts split over this many data-parallel (x context-parallel) "
           "ranks, tokens sent to them and back by all-to-alls.", minimum=1)
    expert_tensor_parallel_size: Optional[int] = option(
        None, "Each expert split over this many tensor-parallel ranks: --tp (the default) or 1 (each TP rank "
              "holds its experts whole and runs them on all its tokens).", minimum=1)

    def __post_init__(self):
        check_minimums(self)


# The training run's model defaults where they differ from GPTConfig's: no dropout for the small
# main-job model, and a position table as long as the sequence.
#: `bench step --model` presets: GPT-2 small and medium as nanoGPT and Megatron-LM train them (the
#: vocabulary padded to 50,304, a multiple of 128).
MODEL_PRESETS = {
    "gpt2-124m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024,
                  "vocab_size": 50304},
    "gpt2-350m": {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
                  "vocab_size": 50304},
}
TRAIN_MODEL_DEFAULTS = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "max_position_embeddings": None}


@dataclass
class TrainConfig:
    """A training run: batch, optimisation, data, checkpoints and logging, plus the model and
    the parallel layout. `TrainConfig.from_flat(**options)` takes every field by its flag name."""
    model: GPTConfig = field(default_factory=lambda: GPTConfig(**{**TRAIN_MODEL_DEFAULTS,
                                                                   "max_position_embeddings": 128}))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seq_length: int = option(128, "Tokens per sample.", minimum=1)
    micro_batch_size: int = option(16, "Samples per forward/backward.", minimum=1)
    global_batch_size: Optional[int] = option(
        None, "Samples per optimizer step = micro-batch x accumulation x DP (default: micro-batch x DP).",
        minimum=1)
    train_iters: int = option(1000, "Optimizer steps.", minimum=1)
    lr: float = option(2e-3, "Peak learning rate.")
    min_lr: float = option(1e-4, "Final learning rate.", minimum=0)
    lr_warmup_iters: int = option(100, "Linear warmup steps: the first update runs at --lr-warmup-init, "
                                       "update N + 1 at --lr (Megatron's schedule).", minimum=0)
    lr_warmup_init: float = option(0.0, "The learning rate the warmup starts from.", minimum=0)
    lr_warmup_fraction: Optional[float] = option(None, "Warmup as a fraction of --lr-decay-iters, in place of "
                                                       "--lr-warmup-iters.", minimum=0)
    lr_decay_iters: Optional[int] = option(None, "Steps over which the learning rate decays to --min-lr "
                                                 "(default: --train-iters).", minimum=1)
    lr_decay_style: str = option("cosine", "Decay after warmup; WSD: warmup, stable, then decay over "
                                           "--lr-wsd-decay-iters.",
                                 choices=("cosine", "linear", "constant", "inverse-square-root", "WSD"))
    lr_wsd_decay_iters: Optional[int] = option(None, "WSD: the decaying steps at the end of --lr-decay-iters.",
                                               minimum=1)
    lr_wsd_decay_style: str = option("linear", "WSD: the shape of its decay.",
                                     choices=("linear", "cosine", "exponential", "minus_sqrt"))
    adam_beta1: float = option(0.9, "AdamW's first-moment decay.", minimum=0)
    adam_beta2: float = option(0.999, "AdamW's second-moment decay.", minimum=0)
    adam_eps: float = option(1e-8, "AdamW's epsilon.", minimum=0)
    weight_decay: float = option(0.01, "AdamW decay (not on biases and LayerNorm).", minimum=0)
    clip_grad: float = option(1.0, "Global gradient-norm clip (0: off).", minimum=0)
    log_interval: int = option(50, "Steps per log line.", minimum=1)
    timing_log_level: int = option(0, "Timers in each interval's log and record: 0 off (free); 1 the step's "
                                      "phases (forward, backward, TP/SP communication, data-parallel "
                                      "communication not hidden, pipeline waits, optimizer), max and min "
                                      "over ranks; 2 also each layer's forward and backward.", minimum=0)
    log_memory: bool = option(False, "Measured peak memory per rank beside the plan's prediction, at the "
                                     "first interval and whenever it grows (on the CPU allocations are "
                                     "traced, which slows a step by about a quarter).")
    peak_tflops: Optional[float] = option(None, "The peak per rank that model-FLOP utilisation is taken "
                                                "against (default: a matrix product measured at start on "
                                                "the CPU, the card's datasheet figure on a GPU).", minimum=0)
    eval_interval: int = option(250, "Steps between validation losses.", minimum=1)
    eval_iters: int = option(10, "Validation batches.", minimum=1)
    log_file: Optional[str] = option(None, "Write metrics as JSON lines here.")
    tensorboard_dir: Optional[str] = option(None, "Write each interval's figures here as TensorBoard scalars, "
                                                  "with Megatron-LM's names (lm loss, learning-rate, grad-norm, "
                                                  "throughput, ...).")
    wandb_project: Optional[str] = option(None, "Log each interval's figures to this Weights & Biases project "
                                                "(pip install 'npmegatron[wandb]'; WANDB_MODE=offline needs no "
                                                "network).")
    wandb_exp_name: Optional[str] = option(None, "The Weights & Biases run's name.")
    wandb_save_dir: Optional[str] = option(None, "Folder for Weights & Biases' files (default: wandb/ in --save, "
                                                 "else ./wandb).")
    data_path: Optional[str] = option(None, "PREFIX written by `npmegatron preprocess` (either format) or "
                                            "by Megatron's preprocess_data.py, or a weighted blend "
                                            "'0.7 PREFIX_A 0.3 PREFIX_B' (default: the embedded corpus).")
    split: Optional[str] = option(None, "Train, validation and test proportions of each --data-path "
                                        "dataset's documents, in order, e.g. 949,50,1 (default: the last "
                                        "documents, about 5 % of the tokens, validate).")
    save: Optional[str] = option(None, "Checkpoint folder to write (locked while the run lasts).")
    overwrite: bool = option(False, "Replace another run's checkpoints in --save (by default that is refused).")
    exit_signal_handler: bool = option(False, "On SIGTERM, finish the iteration, save (with --save) and exit 0.")
    load: Optional[str] = option(None, "Checkpoint folder to resume from (saved at any layout: it is resharded); "
                                       "a folder with no checkpoint yet starts the run from scratch.")
    use_checkpoint_args: bool = option(False, "Take the model's shape (layers, sizes, heads, positions, "
                                              "--seq-length) from the --load checkpoint.")
    no_load_optim: bool = option(False, "With --load: the weights and the iteration, but fresh AdamW moments "
                                        "(and loss scale).")
    no_load_rng: bool = option(False, "With --load: do not restore the dropout position (masks are keyed by "
                                      "--seed and the iteration, so it is set again each step).")
    finetune: bool = option(False, "With --load: start from the checkpoint's weights only, at iteration 0, "
                                   "with a fresh optimizer and data position (fine-tuning, continued "
                                   "pre-training).")
    save_interval: Optional[int] = option(None, "Steps between checkpoints (default: at the end).",
                                          minimum=1)
    exit_duration_in_mins: Optional[float] = option(None, "Save (with --save) and stop after the iteration "
                                                          "that ends past this many minutes of training "
                                                          "(a scheduler's time limit).", minimum=0)
    exit_interval: Optional[int] = option(None, "Save (with --save) and stop when the iteration is a "
                                                "multiple of this.", minimum=1)
    sample_tokens: int = option(200, "Tokens to generate at the end (0: none).", minimum=0)
    loss_scale: Optional[float] = option(None, "A fixed loss scale for --fp16 or --bf16 (default with "
                                               "--fp16: dynamic).", minimum=0)
    initial_loss_scale: float = option(2.0 ** 32, "Dynamic loss scaling's first scale.", minimum=0)
    min_loss_scale: float = option(1.0, "Dynamic loss scaling never goes below this.", minimum=0)
    loss_scale_window: int = option(1000, "Steps without overflow before the scale doubles.", minimum=1)
    hysteresis: int = option(2, "Overflowing steps before the scale halves.", minimum=1)
    cuda_graph: bool = option(False, "Capture the whole training step (forward, backward, gradient "
                                     "reduction, clipping, optimizer) in a CUDA graph after warm-up and "
                                     "replay it: one launch a step from the host (GPU).")
    cuda_graph_warmup_steps: int = option(3, "Eager steps before the capture (--cuda-graph).", minimum=1)

    @classmethod
    def from_flat(cls, **options):
        """The configuration from flag-named options; the model's and the layout's go into
        `model` and `parallel`, and a missing --max-position-embeddings is --seq-length."""
        nested = {}
        for name, config_class, defaults in (("model", GPTConfig, TRAIN_MODEL_DEFAULTS),
                                             ("parallel", ParallelConfig, {})):
            names = {f.name for f in fields(config_class)}
            nested[name] = {**defaults, **{k: options.pop(k) for k in list(options) if k in names}}
        seq_length = options.get("seq_length", field_default(cls, "seq_length"))
        if nested["model"].get("max_position_embeddings") is None and seq_length >= 1:
            nested["model"]["max_position_embeddings"] = seq_length     # else seq_length is refused
        return cls(model=GPTConfig(**nested["model"]), parallel=ParallelConfig(**nested["parallel"]),
                   **options)

    def __post_init__(self):
        check_minimums(self)
        self._check_learning_rates()
        if self.seq_length > self.model.max_position_embeddings:
            raise InputError(f"--seq-length {self.seq_length} is longer than the position table "
                             f"(--max-position-embeddings {self.model.max_position_embeddings}); raise "
                             "--max-position-embeddings or shorten --seq-length")
        self._check_loss_scale()
        self._check_betas()
        self._check_folders()
        if self.use_checkpoint_args and not self.load:
            raise InputError("--use-checkpoint-args reads the model's arguments from the checkpoint "
                             "--load names, but no --load was given; add --load DIR")
        self._check_split()
        self._check_schedule()
        self._check_cuda_graph()
        log_folder = os.path.dirname(os.path.abspath(self.log_file or "."))
        if self.log_file and (not os.path.isdir(log_folder) or os.path.isdir(self.log_file)):
            raise InputError(f"--log-file {self.log_file}: the folder {log_folder} must exist and "
                             f"{self.log_file} must not be a folder; choose another file")

    def _check_learning_rates(self):
        """Megatron's OptimizerParamScheduler asserts 0 <= min_lr <= lr and init_lr <= lr: the
        warmup rises from --lr-warmup-init to --lr, and the decay falls from --lr to --min-lr."""
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"--lr is {self.lr}; the learning rate must be positive, e.g. 1e-3")
        if not self.min_lr <= self.lr:
            raise InputError(f"--min-lr is {self.min_lr}; it must be between 0 and --lr ({self.lr})")
        if self.lr_warmup_init > self.lr:
            raise InputError(f"--lr-warmup-init {self.lr_warmup_init:g} is above --lr {self.lr:g}, but the "
                             f"warmup rises from it to --lr; lower it to at most {self.lr:g} or raise --lr")

    def _check_betas(self):
        for flag, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0 <= beta < 1:
                raise InputError(f"{flag} is {beta}; AdamW's betas must lie in [0, 1) (its bias correction "
                                 f"divides by 1 - beta^t), such as 0.9 for --adam-beta1 and 0.999 for --adam-beta2")

    def _check_folders(self):
        """--tensorboard-dir and --load name folders (missing ones are fine: made, or a fresh start)."""
        if self.tensorboard_dir and os.path.exists(self.tensorboard_dir) and not os.path.isdir(self.tensorboard_dir):
            raise InputError(f"--tensorboard-dir {self.tensorboard_dir} is a file, not a folder; choose a folder "
                             "(it is made if missing)")
        if self.load and os.path.exists(self.load) and not os.path.isdir(self.load):
            raise InputError(f"--load {self.load} is a file, not a checkpoint folder; give the folder --save "
                             "wrote (or one of its iter_NNNNNNN folders)")

    def _check_split(self):
        if self.split is None:
            return
        parse_split(self.split)
        if self.data_path is None:
            raise InputError(f"--split {self.split} divides --data-path datasets, but the run uses the "
                             "embedded corpus; pass --data-path or drop --split")

    def _check_schedule(self):
        """The learning-rate schedule's flags, which only make sense together."""
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters != field_default(TrainConfig, "lr_warmup_iters"):
            raise InputError("--lr-warmup-fraction and --lr-warmup-iters both set the warmup; give one of them")
        if self.lr_warmup_fraction is not None and self.lr_warmup_fraction >= 1:
            raise InputError(f"--lr-warmup-fraction is {self.lr_warmup_fraction}; it is the part of the decay's "
                             "steps spent warming up, and the warmup must end before the decay: give a "
                             "fraction below 1, e.g. 0.01")
        self._check_warmup_ends_before_decay()
        if (self.lr_decay_style == "WSD") != (self.lr_wsd_decay_iters is not None):
            raise InputError("--lr-decay-style WSD needs --lr-wsd-decay-iters (its decaying steps), and "
                             "--lr-wsd-decay-iters needs --lr-decay-style WSD; give both or neither")
        if self.lr_wsd_decay_iters is not None and self.lr_wsd_decay_iters > self.decay_iters:
            raise InputError(f"--lr-wsd-decay-iters {self.lr_wsd_decay_iters} is longer than the decay "
                             f"({self.decay_iters} steps); shorten it")
        if (self.finetune or self.no_load_optim or self.no_load_rng) and not self.load:
            flag = "--finetune" if self.finetune else "--no-load-optim" if self.no_load_optim else "--no-load-rng"
            raise InputError(f"{flag} says what to take from the checkpoint --load names, but no --load was "
                             "given; add --load DIR")

    def _check_warmup_ends_before_decay(self):
        """Megatron asserts warmup < decay. A decay given by --lr-decay-iters that ends inside the
        warmup would drop the rate from its peak straight to --min-lr, so it is refused. A decay
        left at --train-iters is not: the run is then all warmup (the training log warns), and
        this warmup's default of 100 steps must not refuse short runs (Megatron's default is 0)."""
        if self.lr_decay_iters is None or self.lr_warmup_fraction is not None:
            return
        if self.lr_warmup_iters >= self.lr_decay_iters:
            default = " (the default)" if self.lr_warmup_iters == field_default(TrainConfig, "lr_warmup_iters") else ""
            raise InputError(f"--lr-warmup-iters {self.lr_warmup_iters}{default} is not shorter than "
                             f"--lr-decay-iters {self.lr_decay_iters}, but the warmup must end before the "
                             "decay does; shorten the warmup or lengthen the decay")

    @property
    def decay_iters(self):
        """The steps the learning rate decays over: --lr-decay-iters, else --train-iters."""
        return self.lr_decay_iters or self.train_iters

    @property
    def warmup_iters(self):
        """--lr-warmup-iters, or --lr-warmup-fraction of the decay's steps, not rounded to whole
        steps (Megatron's rule: a fraction of the decay's samples)."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.decay_iters
        return self.lr_warmup_iters

    def _check_cuda_graph(self):
        """--cuda-graph replays one captured step: refused, in one sentence, where a step is not the
        same device work every time or needs the host in its middle."""
        if not self.cuda_graph:
            return
        model, parallel = self.model, self.parallel
        refusals = [
            (model.device != "gpu", f"it captures GPU work, but the device is {model.device}; add --device gpu"),
            (parallel.pipeline_model_parallel_size > 1,
             "pipeline parallelism's schedule waits on messages between stages; use --pp 1"),
            (parallel.context_parallel_size > 1,
             "context parallelism's ring of point-to-point messages has not been captured and checked; use --cp 1"),
            (parallel.variable_seq_lengths, "--variable-seq-lengths exchanges shapes on the host; drop it"),
            (model.num_experts is not None, "MoE layers read each expert's token count on the host; drop "
                                            "--num-experts or --cuda-graph"),
            (model.fp16 or self.loss_scale is not None,
             "loss scaling skips an overflowing step, which the host decides after the graph has run; "
             "use --bf16 without --loss-scale"),
        ]
        why = next((reason for refused, reason in refusals if refused), None)
        if why:
            raise InputError(f"--cuda-graph cannot be used here: {why}")

    def _check_loss_scale(self):
        given = [name for name in LOSS_SCALE_FIELDS if getattr(self, name) != field_default(TrainConfig, name)]
        if given and not self.model.storage_format:
            flag = "--" + given[0].replace("_", "-")
            raise InputError(f"{flag} sets loss scaling, which only --fp16 or --bf16 training uses; "
                             f"add --fp16 or drop {flag}")
        for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            if getattr(self, name) == 0:
                raise InputError(f"--{name.replace('_', '-')} is 0; a loss scale must be positive")
        if self.min_loss_scale > self.initial_loss_scale:
            raise InputError(f"--min-loss-scale {self.min_loss_scale:g} is above --initial-loss-scale "
                             f"{self.initial_loss_scale:g}; lower it or raise the initial scale")

    def with_checkpoint_args(self, manifest):
        """This configuration with the model's shape and --seq-length of a checkpoint's manifest
        (--use-checkpoint-args: `--load DIR` alone resumes)."""
        saved = manifest["model"]
        shape = {name: saved[name] for name in CHECKPOINT_MODEL_ARGS if name in saved}
        # A checkpoint from before the model families is GPT-2's (and one from before MoE layers
        # dense): its parts are the defaults, and without grouped-query attention the key/value
        # groups follow the saved heads.
        shape.update({name: field_default(GPTConfig, name) for name in FAMILY_ARGS + MOE_ARGS if name not in saved})
        if not shape["group_query_attention"]:
            shape["num_query_groups"] = None
        seq_length = manifest.get("args", {}).get("seq_length", self.seq_length)
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **shape), seq_length=seq_length)

    def plan(self, world_size):
        """The run's shape on `world_size` ranks (1 without mpirun); see RunPlan."""
        return RunPlan(self, world_size)


class RunPlan:
    """What a configuration means on a given number of ranks: TP, PP, DP, micro-batches per step
    (M, the pipeline's and the gradient accumulation's), the global batch, the layout string."""

    def __init__(self, config, world_size):
        parallel = config.parallel
        self.tp, self.pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        self.cp = parallel.context_parallel_size
        model_ranks = self.tp * self.pp * self.cp
        flags = f"--tp {self.tp} x --pp {self.pp}" + (f" x --cp {self.cp}" if self.cp > 1 else "")
        if world_size == 1 and model_ranks > 1:
            raise InputError(f"{flags} needs {model_ranks} ranks; launch with mpirun -n {model_ranks} "
                             "(or a multiple for data parallelism)")
        if world_size % model_ranks:
            what = "TP x PP" + (" x CP" if self.cp > 1 else "")
            raise InputError(f"world size {world_size} is not divisible by {what} = {model_ranks}; "
                             f"launch a multiple of {what} ranks")
        self.dp = world_size // model_ranks
        self.ep = parallel.expert_model_parallel_size
        self.etp = check_expert_tensor_parallel(config, self.tp)
        if self.ep > 1:
            check_expert_parallel(config, self.ep, self.dp, self.cp)
        if self.cp > 1:
            check_context_parallel_split(config.seq_length, self.cp)
            check_context_parallel_dropout(config.model, self.cp)
        self.micro_batches = self._micro_batches(config)
        self.global_batch = config.micro_batch_size * self.micro_batches * self.dp
        self.layout = self._layout(config)
        self._check_recompute(config)

    def _check_recompute(self, config):
        """Recomputation's chunks fit every model chunk (one sentence here, before any rank builds)."""
        for stage in parse_layout(self.layout):
            recompute_segments(config.model, stage.count("t"))

    def _micro_batches(self, config):
        per_step = config.micro_batch_size * self.dp
        given = config.parallel.num_micro_batches
        if given is not None:
            if config.global_batch_size not in (None, per_step * given):
                raise InputError(f"--num-micro-batches {given} x micro-batch {config.micro_batch_size} x "
                                 f"DP {self.dp} does not give --global-batch-size "
                                 f"{config.global_batch_size}; pass one of the two")
            return given
        global_batch = config.global_batch_size or per_step
        if global_batch % per_step:
            raise InputError(f"--global-batch-size {global_batch} is not divisible by micro-batch x DP = "
                             f"{config.micro_batch_size} x {self.dp} = {per_step}; use a multiple of "
                             f"{per_step}")
        return global_batch // per_step

    def _layout(self, config):
        parallel, num_layers = config.parallel, config.model.num_layers
        if parallel.pipeline_model_parallel_layout:
            return parallel.pipeline_model_parallel_layout
        per_virtual, virtual = parallel.num_layers_per_virtual_pipeline_stage, 1
        if per_virtual is not None:
            if num_layers % (self.pp * per_virtual):
                raise InputError(f"--num-layers-per-virtual-pipeline-stage {per_virtual} does not split "
                                 f"{num_layers} layers over {self.pp} pipeline ranks evenly; choose a "
                                 "divisor of num-layers / PP")
            virtual = num_layers // (self.pp * per_virtual)
        return default_layout(num_layers, self.pp, virtual)


# What --use-checkpoint-args takes from a checkpoint: the model's shape and numerics (Megatron
# takes the same from its saved arguments); parallel layout and training settings stay this run's.
FAMILY_ARGS = ("model_family", "normalization", "position_embedding_type", "rotary_base", "rotary_percent",
               "swiglu", "group_query_attention", "num_query_groups", "untie_embeddings_and_output_weights",
               "disable_bias_linear", "add_qkv_bias")
# The MoE layers' shape and routing (a converted Mixtral or Qwen2-MoE resumes with --load alone).
MOE_ARGS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
            "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
            "moe_router_group_topk", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
CHECKPOINT_MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                         "ffn_hidden_size", "layernorm_epsilon", "gelu", "make_vocab_size_divisible_by") + FAMILY_ARGS \
    + MOE_ARGS
LOSS_SCALE_FIELDS = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def field_default(config_class, name):
    spec = next(f for f in fields(config_class) if f.name == name)
    return spec.default if spec.default is not MISSING else spec.default_factory()
