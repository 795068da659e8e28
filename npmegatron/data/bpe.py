"""Byte-level BPE, GPT-2's tokenizer, through the `tokenizers` package: GPT-2's own vocab.json and
merges.txt made into a tokenizer.json (preprocess --tokenizer-type GPT2BPETokenizer, as Megatron's
flag), and `npmegatron train-tokenizer`, which learns one of N tokens from the user's files and
writes vocab.json, merges.txt and tokenizer.json. Either way the dataset keeps the tokenizer.json
beside its tokens, so training, evaluation and generation read it as any Hugging Face tokenizer."""
import os

from ..autograd import InputError
from .tokenizer import BYTE_VOCAB_SIZE, END_OF_DOCUMENT, tokenizers_package


def gpt2_tokenizer_json(vocab_file, merge_file):
    """GPT-2's tokenizer (byte-level pre-tokenizer and decoder, no prefix space, <|endoftext|>
    kept whole) from its vocab.json and merges.txt, as tokenizer.json text."""
    tokenizers = tokenizers_package("byte-level BPE")
    for path, flag in ((vocab_file, "--vocab-file"), (merge_file, "--merge-file")):
        if not path or not os.path.isfile(path):
            raise InputError(f"{flag} {path} is not a file; GPT2BPETokenizer reads GPT-2's vocab.json "
                             "(--vocab-file) and merges.txt (--merge-file)")
    try:
        model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
    except Exception as error:
        raise InputError(f"--vocab-file {vocab_file} and --merge-file {merge_file} are not a BPE vocabulary "
                         f"and its merges ({error}); pass GPT-2's vocab.json and merges.txt") from None
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    if tokenizer.token_to_id(END_OF_DOCUMENT) is not None:
        tokenizer.add_special_tokens([END_OF_DOCUMENT])
    return tokenizer.to_str()


def train_bpe(files, vocab_size, output_dir):
    """Learn a byte-level BPE of `vocab_size` tokens (the 256 bytes, <|endoftext|> and the merges)
    from `files`; write vocab.json, merges.txt and tokenizer.json into output_dir. Returns
    {"vocab_size", "files", "bytes"}."""
    tokenizers = tokenizers_package("byte-level BPE")
    if vocab_size <= BYTE_VOCAB_SIZE + 1:
        raise InputError(f"--vocab-size {vocab_size} leaves no room for merges: a byte-level BPE holds the 256 "
                         f"bytes and {END_OF_DOCUMENT} first; ask for more, e.g. 8192")
    if not files:
        raise InputError("no input files to learn the tokenizer from; pass text files or folders")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise InputError(f"--output {output_dir} cannot be made ({e.strerror}); choose another folder") from None
    tokenizer = tokenizers.implementations.ByteLevelBPETokenizer(add_prefix_space=False)
    # each file's text as preprocess reads it: UTF-8, any byte that is not replaced by U+FFFD
    tokenizer.train_from_iterator(_texts(files), vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[END_OF_DOCUMENT], length=len(files))
    tokenizer.save_model(output_dir)
    tokenizer.save(os.path.join(output_dir, "tokenizer.json"))
    return {"vocab_size": tokenizer.get_vocab_size(), "files": len(files),
            "bytes": sum(os.path.getsize(path) for path in files)}


def _texts(files):
    for path in files:
        try:
            with open(path, "rb") as f:
                yield f.read().decode("utf-8", errors="replace")
        except OSError as e:
            raise InputError(f"cannot read {path} ({e.strerror}); pass readable text files") from None
