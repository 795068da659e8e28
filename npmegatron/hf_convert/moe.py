"""Hugging Face Mixtral (MixtralForCausalLM) and Qwen2-MoE (Qwen2MoeForCausalLM) <-> npmegatron,
the mixture-of-experts families' half of convert.py (issue 55): config.json's fields and the MoE
layers' tensor names, both ways. The decoder around them (embeddings, attention, RMSNorm, rotary
angles, the head) is Llama's, read and written by llama.py; Qwen2-MoE's q, k, v biases are joined
group by group like their weights, into our QKV bias (--add-qkv-bias).

Under "model.layers.N.", HF's linears (out, in) TRANSPOSED, the router and the shared expert's
gate as they are; ours are under "blocks.N.mlp.", each expert's a slice of the stacked weight
("experts.gate.weight" (E, h, f): stack_experts and unstack_experts):

    Mixtral (block_sparse_moe.)  Qwen2-MoE (mlp.)                    npmegatron              shape
    gate.weight                  gate.weight                         router.weight           (E, h)
    experts.e.w1.weight          experts.e.gate_proj.weight          experts.gate.weight[e]  (h, f)
    experts.e.w3.weight          experts.e.up_proj.weight            experts.up.weight[e]    (h, f)
    experts.e.w2.weight          experts.e.down_proj.weight          experts.proj.weight[e]  (f, h)
                                 shared_expert.gate_proj / up_proj   shared_expert.gate / up (h, s)
                                 shared_expert.down_proj.weight      shared_expert.proj      (s, h)
                                 shared_expert_gate.weight           shared_expert_gate      (1, h)

Every Mixtral layer is MoE; a Qwen2-MoE layer is dense (Llama's mlp.gate_proj, up_proj, down_proj,
intermediate_size) when listed in mlp_only_layers or when its number plus one is not a multiple of
decoder_sparse_step: --moe-layer-freq's pattern. Both routers take a softmax over all experts and
its top k; Mixtral, and Qwen2-MoE with norm_topk_prob, renormalise the k weights, which equals our
softmax over the k largest logits; Qwen2-MoE without it keeps them (--moe-router-pre-softmax). The
shared expert's output is scaled by sigmoid(x w) (--moe-shared-expert-gate).

Written: Mixtral when the model is one (every layer MoE, no shared expert, no QKV bias, weights
renormalised), else Qwen2-MoE when it has a gated shared expert, else refused in one sentence, as
is any routing neither computes. Experts fused into one tensor (transformers 5's in-memory
gate_up_proj) are not read: save_pretrained writes them one by one, as here.
"""
import re

import numpy

from ..autograd import InputError
from ..config import GPTConfig
from ..safetensors_header import shown as _shown
from .checks import NOT_NEGATIVE, check_sizes, config_numbers, finite
from .llama import (LLAMA_DEFAULTS, decoder_config_from_hf, decoder_config_to_hf, dense_mlp_names, llama_name_map,
                    llama_sizes_held)

# What MixtralConfig and Qwen2MoeConfig assume for a field config.json leaves out (transformers 4 and 5).
MIXTRAL_DEFAULTS = {**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                    "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                    "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
                    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}
QWEN2_MOE_DEFAULTS = {**LLAMA_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                      "max_position_embeddings": 32768, "use_sliding_window": False, "decoder_sparse_step": 1,
                      "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                      "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
                      "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "qkv_bias": True, "layer_types": None}
PLAIN_ROPE = ("rope_scaling", (None, "scaled rotary angles, such as YaRN, are not implemented"))
MIXTRAL_REQUIRED = dict([("hidden_act", ("silu", "the experts' SwiGLU gate is silu")), PLAIN_ROPE])
QWEN2_MOE_REQUIRED = dict([("hidden_act", ("silu", "the experts' SwiGLU gate is silu")), PLAIN_ROPE,
                           ("use_sliding_window", (False, "sliding-window attention is not implemented"))])
# What neither HF model computes: (is it so, what the model has, the fix).
UNSUPPORTED = (
    (lambda c: c.moe_router_score_function != "softmax", "sigmoid routing", "route with softmax"),
    (lambda c: c.moe_router_num_groups is not None, "group-limited routing", "drop --moe-router-num-groups"),
    (lambda c: c.moe_router_enable_expert_bias, "the expert bias", "drop --moe-router-enable-expert-bias"),
    (lambda c: c.moe_router_topk_scaling_factor not in (None, 0, 1), "a top-k scaling factor",
     "drop --moe-router-topk-scaling-factor"),
    (lambda c: c.moe_expert_capacity_factor is not None, "an expert capacity factor, which drops tokens",
     "drop --moe-expert-capacity-factor"),
)


def mixtral_config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF Mixtral config.json: Llama's decoder with an MoE
    layer in every layer, intermediate_size the experts' size. The router's jitter noise and
    sliding-window attention shorter than the positions are not computed, so they are refused."""
    get = lambda key: hf_config.get(key, MIXTRAL_DEFAULTS.get(key))   # noqa: E731
    kwargs = decoder_config_from_hf(hf_config, MIXTRAL_DEFAULTS, MIXTRAL_REQUIRED)
    if finite(get("router_jitter_noise")) != 0:
        raise InputError(f"config.json has router_jitter_noise {_shown(get('router_jitter_noise'))}; npmegatron "
                         "supports only 0 (its router does not scale the hidden states by random noise)")
    window, positions = get("sliding_window"), kwargs["max_position_embeddings"]
    if window is not None and not (type(window) is int and window >= positions):
        raise InputError(f"config.json has sliding_window {_shown(window)}; npmegatron supports only null or at least "
                         f"max_position_embeddings {positions} (sliding-window attention is not implemented)")
    return {**kwargs, **_experts(get, "num_local_experts"), "moe_ffn_hidden_size": kwargs["ffn_hidden_size"],
            "moe_layer_freq": "1", "moe_router_pre_softmax": False}


def qwen2_moe_config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF Qwen2-MoE config.json: Llama's decoder with q, k, v
    biases (qkv_bias, which transformers 4 always has), MoE layers with a gated shared expert
    where decoder_sparse_step and mlp_only_layers put them, and norm_topk_prob as the router's
    renormalisation (its absence is --moe-router-pre-softmax)."""
    get = lambda key: hf_config.get(key, QWEN2_MOE_DEFAULTS.get(key))   # noqa: E731
    kwargs = decoder_config_from_hf(hf_config, QWEN2_MOE_DEFAULTS, QWEN2_MOE_REQUIRED)
    for key in ("norm_topk_prob", "qkv_bias"):
        if type(get(key)) is not bool:
            raise InputError(f"config.json has {key} {_shown(get(key))}; it must be true or false")
    sizes = {key: get(key) for key in ("moe_intermediate_size", "shared_expert_intermediate_size",
                                       "decoder_sparse_step")}
    check_sizes(sizes)
    layers = kwargs["num_layers"]
    types = get("layer_types")
    if types is not None and types != ["full_attention"] * layers:
        raise InputError(f"config.json has layer_types {_shown(types)}; npmegatron supports only "
                         f"{layers} times 'full_attention' (sliding-window attention is not implemented)")
    return {**kwargs, **_experts(get, "num_experts"), "add_qkv_bias": get("qkv_bias"),
            "moe_ffn_hidden_size": sizes["moe_intermediate_size"],
            "moe_shared_expert_intermediate_size": sizes["shared_expert_intermediate_size"],
            "moe_shared_expert_gate": True, "moe_router_pre_softmax": not get("norm_topk_prob"),
            "moe_layer_freq": _pattern(_qwen2_moe_layers(get, layers, sizes["decoder_sparse_step"]))}


def _experts(get, key):
    """The router's fields: `key` experts (each family names them its own way), the top k, and
    the load-balancing loss's coefficient (docs/design.md: where HF's loss and Megatron's differ)."""
    sizes = {key: get(key), "num_experts_per_tok": get("num_experts_per_tok")}
    check_sizes(sizes)
    if sizes["num_experts_per_tok"] > sizes[key]:
        raise InputError(f"config.json has num_experts_per_tok {sizes['num_experts_per_tok']}, more than {key} "
                         f"{sizes[key]}; give the config.json saved with these weights")
    coefficient = config_numbers(get, {"router_aux_loss_coef": NOT_NEGATIVE})["router_aux_loss_coef"]
    return {"num_experts": sizes[key], "moe_router_topk": sizes["num_experts_per_tok"],
            "moe_aux_loss_coeff": coefficient}


def _qwen2_moe_layers(get, layers, step):
    """One 0 (dense) or 1 (MoE) per layer, as Qwen2MoeDecoderLayer chooses: MoE unless listed in
    mlp_only_layers or (n + 1) is not a multiple of decoder_sparse_step."""
    dense = get("mlp_only_layers")
    if not (isinstance(dense, list) and all(type(n) is int and 0 <= n < layers for n in dense)):
        raise InputError(f"config.json has mlp_only_layers {_shown(dense)}; it must be a list of layer numbers "
                         f"from 0 to {layers - 1}")
    return [int(n not in dense and (n + 1) % step == 0) for n in range(layers)]


def _pattern(flags):
    """--moe-layer-freq for one 0/1 per layer: "1" when every layer is MoE, else Megatron's
    pattern of runs, such as "([0]*1+[1]*3)"."""
    if all(flags):
        return "1"
    runs = []
    for flag in flags:
        if runs and runs[-1][0] == flag:
            runs[-1][1] += 1
        else:
            runs.append([flag, 1])
    return "(" + "+".join(f"[{flag}]*{count}" for flag, count in runs) + ")"


def moe_family(cfg: GPTConfig):
    """'mixtral' or 'qwen2_moe': which HF model a Llama-family model with MoE layers is. Mixtral
    when it can be; Qwen2-MoE when it has the gated shared expert Qwen2-MoE always has; else, and
    for routing neither computes, refused in one sentence."""
    for holds, what, fix in UNSUPPORTED:
        if holds(cfg):
            raise InputError(f"the model has {what}, which neither Hugging Face's MixtralForCausalLM nor "
                             f"Qwen2MoeForCausalLM computes; {fix} to convert it")
    not_mixtral = [what for what, has in (("a shared expert", cfg.moe_shared_expert_intermediate_size),
                                          ("QKV biases (--add-qkv-bias)", cfg.add_qkv_bias),
                                          ("dense layers (--moe-layer-freq)", not all(cfg.moe_layers)),
                                          ("--moe-router-pre-softmax", cfg.moe_router_pre_softmax)) if has]
    if not not_mixtral:
        return "mixtral"
    if cfg.moe_shared_expert_intermediate_size and cfg.moe_shared_expert_gate:
        return "qwen2_moe"
    lacks = ("no gate on its shared expert (--moe-shared-expert-gate)" if cfg.moe_shared_expert_intermediate_size
             else "no shared expert")
    raise InputError(f"the model has {not_mixtral[0]}, which Hugging Face's MixtralForCausalLM does not, and "
                     f"{lacks}, which its Qwen2MoeForCausalLM needs; only a model one of the two computes can "
                     "be converted")


def moe_config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """A complete config.json for MixtralForCausalLM or Qwen2MoeForCausalLM, as moe_family says.
    Qwen2-MoE's layers are written as decoder_sparse_step 1 and mlp_only_layers listing the dense
    ones; its qkv_bias (transformers 5's field) says whether q, k and v have biases."""
    shared = {**decoder_config_to_hf(cfg, bos_token_id, eos_token_id), "num_experts_per_tok": cfg.moe_router_topk,
              "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "output_router_logits": False}
    if moe_family(cfg) == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **shared,
                "intermediate_size": cfg.moe_ffn_hidden_size, "head_dim": cfg.head_dim,
                "num_local_experts": cfg.num_experts, "router_jitter_noise": 0.0, "sliding_window": None}
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **shared,
            "intermediate_size": cfg.ffn_hidden_size, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
            "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
            "num_experts": cfg.num_experts, "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": [n for n in range(cfg.num_layers) if not cfg.is_moe_layer(n)],
            "qkv_bias": cfg.add_qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers, "layer_types": ["full_attention"] * cfg.num_layers}


def moe_name_map(cfg):
    """llama_name_map's list for a Mixtral or Qwen2-MoE configuration: Llama's decoder, each
    layer's MLP its family's."""
    return llama_name_map(cfg, mixtral_mlp_names if moe_family(cfg) == "mixtral" else qwen2_moe_mlp_names)


def mixtral_mlp_names(cfg, n):
    """Layer n's MoE layer in Mixtral's names: the router, then w1 (gate), w3 (up), w2 (down) of
    each expert."""
    h, f, moe = cfg.hidden_size, cfg.moe_ffn_hidden_size, "block_sparse_moe"
    names = [((f"{moe}.gate.weight",), "mlp.router.weight", (cfg.num_experts, h))]
    for e in range(cfg.num_experts):
        names += [((f"{moe}.experts.{e}.{hf}.weight",), f"mlp.experts.{e}.{ours}.weight", shape)
                  for hf, ours, shape in (("w1", "gate", (h, f)), ("w3", "up", (h, f)), ("w2", "proj", (f, h)))]
    return names


def qwen2_moe_mlp_names(cfg, n):
    """Layer n's MLP in Qwen2-MoE's names: Llama's dense one, or the shared expert's gate, the
    router, the experts and the shared expert."""
    if not cfg.is_moe_layer(n):
        return dense_mlp_names(cfg, n)
    h = cfg.hidden_size
    names = [(("mlp.shared_expert_gate.weight",), "mlp.shared_expert_gate", (1, h)),
             (("mlp.gate.weight",), "mlp.router.weight", (cfg.num_experts, h))]
    for e in range(cfg.num_experts):
        names += dense_mlp_names(cfg, n, f"mlp.experts.{e}", f"mlp.experts.{e}", cfg.moe_ffn_hidden_size)
    return names + dense_mlp_names(cfg, n, "mlp.shared_expert", "mlp.shared_expert",
                                   cfg.moe_shared_expert_intermediate_size)


def moe_sizes_held(cfg):
    """llama_sizes_held's list plus the MoE sizes, read from the first MoE layer's tensors."""
    first = next((n for n in range(cfg.num_layers) if cfg.is_moe_layer(n)), None)
    if first is None:
        return llama_sizes_held(cfg)
    if moe_family(cfg) == "mixtral":
        layer = f"layers.{first}.block_sparse_moe"
        return llama_sizes_held(cfg) + [
            ("intermediate_size", cfg.moe_ffn_hidden_size, f"{layer}.experts.0.w1.weight", 0),
            ("num_local_experts", cfg.num_experts, f"{layer}.gate.weight", 0)]
    layer = f"layers.{first}.mlp"
    return llama_sizes_held(cfg) + [
        ("moe_intermediate_size", cfg.moe_ffn_hidden_size, f"{layer}.experts.0.gate_proj.weight", 0),
        ("shared_expert_intermediate_size", cfg.moe_shared_expert_intermediate_size,
         f"{layer}.shared_expert.gate_proj.weight", 0),
        ("num_experts", cfg.num_experts, f"{layer}.gate.weight", 0)]


#: One routed expert's weight in the name maps: "<layer>.experts.<e>.<projection>.<kind>".
_ONE_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+\.\w+)$")


def stack_experts(masters):
    """The name maps' one-expert masters joined into the model's stacked ones: each layer's
    "experts.e.gate.weight" (h, f), e = 0 ... E - 1, becomes "experts.gate.weight" (E, h, f)."""
    out, stacks = {}, {}
    for name, array in masters.items():
        match = _ONE_EXPERT.match(name)
        if match is None:
            out[name] = array
        else:
            stacks.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = array
    for name, experts in stacks.items():
        out[name] = numpy.stack([experts[e] for e in range(len(experts))])
    return out


def unstack_experts(masters):
    """stack_experts' inverse: the model's stacked expert masters split one expert a name."""
    out = {}
    for name, array in masters.items():
        layer, _, projection = name.rpartition(".experts.")
        if layer and projection.count(".") == 1 and not projection.split(".")[0].isdigit():
            out.update({f"{layer}.experts.{e}.{projection}": numpy.ascontiguousarray(array[e])
                        for e in range(array.shape[0])})
        else:
            out[name] = array
    return out
