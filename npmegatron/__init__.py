"""npmegatron: Megatron-LM (Shoeybi et al., 2019) rebuilt on NumPy and CuPy.

`npmegatron.autograd` is the tensor engine, `npmegatron.comm` the communication layer, and this
package the model-parallel library on top: GPT-2, training, benchmarks and the CLI.
"""
__version__ = "0.1.0"
