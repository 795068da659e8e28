"""Data: the embedded default corpus (corpus.py), tokenizers (tokenizer.py), `npmegatron preprocess`
(preprocessing.py, its documents tokenized over --workers processes in tokenizing.py), Megatron's indexed format (indexed.py), the datasets, splits and weighted blends
a run reads (datasets.py), and the deterministic window samplers (sampling.py).

A preprocessed dataset is two files, as Megatron's indexed datasets and nanoGPT's train.bin:
PREFIX.bin, every document's tokens back to back in the narrowest unsigned type that holds the
vocabulary (uint8 for bytes, uint16, else uint32), read through a memory map; and PREFIX.json,
the index (token dtype, document boundaries, vocabulary size, tokenizer). A Hugging Face
tokenizer is copied beside them as PREFIX.tokenizer.json, so the dataset (and a checkpoint
trained on it) can decode text without the original file.

Megatron's own format (indexed.py: PREFIX.bin + PREFIX.idx) is written for JSONL input and
`--output-format megatron`. Its .idx says nothing of the vocabulary, so a small sidecar
PREFIX.npmegatron.json records it (and the tokenizer); data made by Megatron's preprocess_data.py
trains once its tokenizer.json is put beside it as PREFIX.tokenizer.json.
"""
from .corpus import load_default_corpus, stdlib_python_files
from .datasets import (MegatronDataset, TokenDataset, TrainingData, check_index, open_dataset,
                       parse_blend, parse_split, split_boundaries)
from .preprocessing import choose_output_format, preprocess, preprocess_megatron, token_dtype
from .sampling import Blend, BlendedSampler, WindowSampler, make_sampler
from .tokenizer import ByteTokenizer, HFTokenizer, tokenizer_from_spec, utf8_bytes

__all__ = ["Blend", "BlendedSampler", "ByteTokenizer", "HFTokenizer", "MegatronDataset", "TokenDataset",
           "TrainingData", "WindowSampler", "check_index", "choose_output_format", "load_default_corpus",
           "make_sampler", "open_dataset", "parse_blend", "parse_split", "preprocess",
           "preprocess_megatron", "split_boundaries", "stdlib_python_files", "token_dtype",
           "tokenizer_from_spec", "utf8_bytes"]
