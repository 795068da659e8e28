"""Tokenizers: UTF-8 bytes (vocabulary 256, the default) or a local Hugging Face tokenizer.json,
and the end-of-document token Megatron's preprocess_data.py appends (--append-eod). Named
tokenizer.py, not tokenizers.py, so it is never mistaken for the `tokenizers` package it wraps."""
import os

from ..autograd import InputError

BYTE_VOCAB_SIZE = 256
END_OF_DOCUMENT = "<|endoftext|>"        # GPT-2's, and Megatron's GPT tokenizers' end-of-document token


def utf8_bytes(text, what="the text"):
    """`text` as UTF-8. Python carries bytes that are not UTF-8 (in argv, or read with
    surrogateescape) as lone surrogates, which UTF-8 cannot encode."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InputError(f"{what} is not UTF-8 text ({text[error.start:error.end]!r} at character "
                         f"{error.start}); pass it as UTF-8") from None


def tokenizers_package(what="a tokenizer.json"):
    """The `tokenizers` package (the hf extra), or one sentence saying `what` needs it and how to
    install it."""
    try:
        import tokenizers
    except ImportError:
        raise InputError(f"{what} needs the `tokenizers` package; install it with "
                         "pip install 'npmegatron[hf]'") from None
    return tokenizers


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, nothing to download."""
    spec = {"type": "bytes"}
    vocab_size = BYTE_VOCAB_SIZE
    eod_id = None                  # every byte is text: there is no id left for an end of document

    def encode(self, text):
        return list(utf8_bytes(text))

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def byte_count(self, ids):
        """How many bytes of text the tokens stand for (a loss per byte divides by it)."""
        return len(ids)


class HFTokenizer:
    """A local Hugging Face tokenizer.json, through the `tokenizers` package (no network)."""

    def __init__(self, path):
        Tokenizer = tokenizers_package().Tokenizer
        if not os.path.isfile(path):
            raise InputError(f"tokenizer file {path} does not exist; pass a Hugging Face tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as error:
            raise InputError(f"tokenizer file {path} could not be read ({error}); pass a Hugging "
                             "Face tokenizer.json") from None
        self.path = path
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.spec = {"type": "huggingface"}
        self.eod_id = self.tokenizer.token_to_id(END_OF_DOCUMENT)    # None when it has no such token

    def encode(self, text):
        utf8_bytes(text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids])

    def byte_count(self, ids):
        """How many bytes of UTF-8 text the tokens decode to (a loss per byte divides by it)."""
        return len(self.decode(ids).encode("utf-8"))


def tokenizer_from_spec(spec, tokenizer_file=None):
    """The tokenizer an index or checkpoint describes; Hugging Face ones read `tokenizer_file`."""
    if spec.get("type") == "huggingface":
        return HFTokenizer(tokenizer_file)
    return ByteTokenizer()

def end_of_document_id(tokenizer, tokenizer_file):
    """The id --append-eod appends: the tokenizer's <|endoftext|>, GPT-2's and Megatron's choice."""
    if tokenizer.eod_id is not None:
        return tokenizer.eod_id
    if tokenizer_file is None:
        raise InputError(f"--append-eod needs an end-of-document token, which the byte-level tokenizer "
                         f"lacks (its 256 ids are all bytes); pass --tokenizer with a tokenizer.json that "
                         f"has {END_OF_DOCUMENT}, or drop --append-eod")
    raise InputError(f"--append-eod needs an end-of-document token, but tokenizer file {tokenizer_file} "
                     f"has no {END_OF_DOCUMENT}; use a tokenizer that has one, or drop --append-eod")
