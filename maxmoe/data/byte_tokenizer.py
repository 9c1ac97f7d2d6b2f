"""The byte-level tokenizer: byte b -> token b; 256 BOS, 257 EOS, 258 PAD, 259 reserved."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 260


def byte_tokens(data: bytes) -> np.ndarray:
    """Byte-level tokens: byte b -> token b."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode_bytes(tokens: Iterable[int]) -> bytes:
    """Bytes of byte-level tokens; special tokens (>= 256) are dropped."""
    array = np.asarray(tokens)
    return array[array < 256].astype(np.uint8).tobytes()
