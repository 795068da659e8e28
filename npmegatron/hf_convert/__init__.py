"""Each model family's half of Hugging Face conversion (issue 16): gpt2.py and llama.py map their
config.json fields, tensor names and QKV order, with checks.py's tests of config.json's values.
The commands, and the checks of tensors both families share, are npmegatron/convert.py's.
"""
