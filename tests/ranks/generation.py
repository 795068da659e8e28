"""Rank program for tests/npmegatron/test_generation.py: on 2 ranks, TP = 2 generation (with and
without sequence parallelism), or PP = 2 generation, samples the tokens the serial model samples;
each rank prints "same <number of tokens>".

    mpiexec -n 2 python tests/ranks/generation.py tp-equals-serial|pp-equals-serial '<GPTConfig keywords as JSON>'
"""
import argparse
import dataclasses
import json

from npmegatron import comm
from npmegatron.generation import generate
from npmegatron.model import GPT, GPTConfig


def tp_equals_serial(config):
    cfg = GPTConfig(**config)
    serial = generate(GPT(cfg), [1, 2, 3], 15, temperature=0.7, top_k=20, seed=4)
    comm.init()
    parallel = generate(GPT(cfg, comm.ProcessGrid(tp=2)), [1, 2, 3], 15, temperature=0.7,
                        top_k=20, seed=4)
    assert parallel == serial, (parallel, serial)
    sp = GPT(dataclasses.replace(cfg, sequence_parallel=True), comm.ProcessGrid(tp=2))
    assert generate(sp, [1, 2, 3], 15, temperature=0.7, top_k=20, seed=4) == serial
    print("same " + str(len(serial)), flush=True)


def pp_equals_serial(config):
    """Two pipeline stages, one per rank (no key/value cache across stages), sample what the
    serial model samples with its cache, also past the position table (both slide)."""
    from npmegatron.run import build_model
    cfg = GPTConfig(**config)
    comm.init()
    staged = build_model(cfg, comm.ProcessGrid(pp=2))
    for new_tokens in (15, 40):
        serial = generate(GPT(cfg), [1, 2, 3], new_tokens, temperature=0.7, top_k=20, seed=4)
        assert generate(staged, [1, 2, 3], new_tokens, temperature=0.7, top_k=20, seed=4) == serial
    print("same " + str(len(serial)), flush=True)


CASES = {"tp-equals-serial": tp_equals_serial, "pp-equals-serial": pp_equals_serial}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("config", type=json.loads, help="GPTConfig keyword arguments, as a JSON object")
    args = parser.parse_args(argv)
    CASES[args.case](args.config)


if __name__ == "__main__":
    main()
