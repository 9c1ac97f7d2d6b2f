"""Token batches for training and evaluation: synthetic, the built-in stdlib corpus, token folders.

    make_dataset(config, split="train", process_index=p, process_count=P) -> BatchIterator

yields numpy int32 arrays [train.batch_size / P, train.seq_len + 1] (inputs row[:-1], targets
row[1:]). Every batch is a pure function of (train.seed, step, global row): process p gets rows
[p * b, (p + 1) * b) of the global batch, so the data a run sees depends on neither the mesh
shape nor the process count. Sources (`data.source`): synthetic, stdlib (the running Python's
standard library, byte-level), shards (a token folder, or text tokenised once into a cached
one), auto (shards when data.path or data.mixture is given, else stdlib). docs/ARCHITECTURE.md,
"Data", has the modules and the formats.
"""

from maxmoe.data.batches import (
    BatchIterator,
    check_same_data,
    data_fingerprint,
    data_folders,
    make_dataset,
    resolve_vocab_size,
    vocab_size_note,
    vocab_size_of,
)
from maxmoe.data.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, byte_tokens, decode_bytes
from maxmoe.data.mixture import mixture_sources
from maxmoe.data.stdlib import STDLIB_SKIP_DIRS, stdlib_corpus, stdlib_files
from maxmoe.data.text_cache import token_folder_for
from maxmoe.data.token_folder import (
    EVAL_SPLIT_RULE,
    FORMAT,
    FORMAT_VERSION,
    check_eval_fraction,
    eval_split,
    load_tokens,
    read_meta,
    token_dtype,
    write_token_folder,
)

__all__ = [
    "BOS_ID",
    "BYTE_VOCAB_SIZE",
    "EOS_ID",
    "EVAL_SPLIT_RULE",
    "FORMAT",
    "FORMAT_VERSION",
    "PAD_ID",
    "STDLIB_SKIP_DIRS",
    "BatchIterator",
    "byte_tokens",
    "check_same_data",
    "check_eval_fraction",
    "data_fingerprint",
    "data_folders",
    "decode_bytes",
    "eval_split",
    "load_tokens",
    "make_dataset",
    "mixture_sources",
    "read_meta",
    "resolve_vocab_size",
    "stdlib_corpus",
    "stdlib_files",
    "token_dtype",
    "token_folder_for",
    "vocab_size_note",
    "vocab_size_of",
    "write_token_folder",
]
