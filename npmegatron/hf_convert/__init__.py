"""Each model family's half of Hugging Face conversion (issues 16 and 55): gpt2.py, llama.py and
moe.py (Mixtral and Qwen2-MoE, on llama.py's decoder) map their config.json fields, tensor names
and QKV order, with checks.py's tests of config.json's values. The commands, and the checks of
tensors the families share, are npmegatron/convert.py's.
"""
