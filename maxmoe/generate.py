"""`python -m maxmoe.generate`: sample text from a trained or converted model, with a latent KV cache.

    python -m maxmoe.generate --run runs/tiny --prompt "import os" --max-new-tokens 40 --temperature 0
    python -m maxmoe.generate --checkpoint ckpt/v3 --prompt "The capital of France is" --top-p 0.9

--run reads a training run folder (its latest checkpoint and config.yaml); --checkpoint a
folder `python -m maxmoe.convert from-hf` wrote (or a Hugging Face folder). The tokenizer is
--tokenizer (`byte` or a tokenizer.json), else the folder's tokenizer.json, else the one the
run trained with (the byte-level corpus: prompt and output are bytes). Sampling:
--temperature 0 is greedy; otherwise softmax(logits / temperature), cut to the --top-k most
likely tokens and to the smallest set holding --top-p of the probability, drawn with --seed.
Generation stops after --max-new-tokens or at the end-of-document token. Prints the prompt
and its continuation. In Python: `generate` (token ids) and `generate_text` (strings).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe import runtime
from maxmoe.cli import _Parser, exit_with, main_guard, path_argument
from maxmoe.config import ConfigError, ModelConfig, UserError, load_config
from maxmoe.config.yaml_reader import read_yaml
from maxmoe.convert.hf import load_pretrained
from maxmoe.data import EOS_ID, byte_tokens, data_folders, decode_bytes, read_meta
from maxmoe.model.decode import decode, init_cache
from maxmoe.training.checkpoint import latest_step_of

# End-of-text tokens of common tokenizers, tried in order (DeepSeek-V3's first).
EOS_NAMES = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """The byte-level corpus' tokenizer: UTF-8 bytes in, bytes out; EOS ends a document."""

    eos_id = EOS_ID
    vocab_size = 256

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        # A document starts after an EOS in the corpus, so an empty prompt starts a new document.
        return byte_tokens(data).tolist() or [EOS_ID]

    def decode(self, ids: Sequence[int]) -> bytes:
        return decode_bytes(ids)


class JsonTokenizer:
    """A Hugging Face tokenizer.json (needs the `tokenizers` package); text is UTF-8 bytes out."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(f"tokenizer {path} needs the `tokenizers` package: pip install tokenizers") from None
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exception for malformed files
            raise UserError(f"tokenizer {path}: cannot load it ({str(e).splitlines()[0] if str(e) else e!r})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for i in map(self._tokenizer.token_to_id, EOS_NAMES) if i is not None), None)

    def encode(self, text: str | bytes) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> bytes:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True).encode("utf-8")


def tokenizer_for(folder: str | Path, spec: str = "") -> ByteTokenizer | JsonTokenizer:
    """`spec` ('byte' or a tokenizer.json), else `folder`/tokenizer.json, else what the run in `folder` trained on."""
    folder = Path(folder)
    if spec == "byte":
        return ByteTokenizer()
    if spec:
        if not Path(spec).is_file():
            raise UserError(f"--tokenizer {spec}: expected 'byte' or the path of a tokenizer.json file")
        return JsonTokenizer(spec)
    if (folder / "tokenizer.json").is_file():
        return JsonTokenizer(folder / "tokenizer.json")
    config_path = folder / "config.yaml"
    try:
        raw = read_yaml(config_path.read_bytes().decode("utf-8"), str(config_path)) if config_path.is_file() else None
    except (OSError, UnicodeDecodeError, ConfigError) as e:
        reason = e if isinstance(e, ConfigError) else getattr(e, "strerror", None) or "not UTF-8 text"
        raise UserError(
            f"no tokenizer for {folder}: its config.yaml cannot be read ({reason}); "
            f"pass --tokenizer PATH/tokenizer.json (or --tokenizer byte)"
        ) from None
    if not (isinstance(raw, dict) and "data" in raw):
        raise UserError(
            f"no tokenizer for {folder}: it has no tokenizer.json and no training config; "
            f"pass --tokenizer PATH/tokenizer.json (or --tokenizer byte)"
        )
    try:
        run_config = load_config(config_path, stored=True)  # a run's own config: earlier keys translated
        if run_config.data.kind in ("stdlib", "synthetic"):
            return ByteTokenizer()
        data_folder = data_folders(run_config)[0][0]  # a mixture's folders share one vocabulary
        name = read_meta(data_folder).get("tokenizer", "")
    except UserError as e:  # e.g. a relative data.path, run from another directory
        raise UserError(
            f"no tokenizer for {folder}: the run's data cannot be read from here ({e}); "
            f"pass --tokenizer PATH/tokenizer.json (or --tokenizer byte)"
        ) from None
    if name == "byte":
        return ByteTokenizer()
    if not name or not Path(name).is_file():
        raise UserError(
            f"the run's data ({data_folder}) names tokenizer {name!r}, which is not a file; pass --tokenizer"
        )
    return JsonTokenizer(name)


# ----------------------------------------------------------------------------- sampling


def sample_token(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next token ids [B]: argmax at temperature 0, else a draw from the top-k / top-p cut of softmax(logits / T)."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV.astype(jnp.float32) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_BV, axis=-1)
        # Keep a token while the mass of the more likely ones is below top_p (the first always stays).
        kept = jnp.cumsum(probs, axis=-1) - probs < top_p
        threshold = jnp.min(jnp.where(kept, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int = 0) -> None:
    """UserError for settings of the wrong type or outside their ranges (the command line's and the API's)."""
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise UserError(f"{name}={value!r:.80}: expected an integer")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise UserError(f"{name}={value!r:.80}: expected a number")
    if not 0 <= seed < 2**32:  # jax.random.key keeps 32 bits: larger seeds repeat smaller ones
        raise UserError(f"seed={seed}: expected 0 to {2**32 - 1}")
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if not np.isfinite(temperature) or temperature < 0:
        raise UserError(f"temperature={temperature}: must be >= 0 (0: greedy)")
    if top_k < 0:
        raise UserError(f"top_k={top_k}: must be >= 0 (0: off)")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p}: must be in (0, 1] (1: off)")


@functools.lru_cache(maxsize=8)
def _programs(model: ModelConfig, temperature: float, top_k: int, top_p: float):
    """(prefill, step) jitted for one model and one sampling setting; each picks the next token."""

    def prefill(variables, tokens_BT, cache, key):
        logits, cache = decode(model, variables, tokens_BT, cache, 0)
        position = tokens_BT.shape[1]  # where the drawn token goes
        return sample_token(logits[:, -1], jax.random.fold_in(key, position), temperature, top_k, top_p), cache

    def step(variables, token_B, cache, position, key):
        logits, cache = decode(model, variables, token_B[:, None], cache, position)
        return sample_token(logits[:, -1], jax.random.fold_in(key, position + 1), temperature, top_k, top_p), cache

    return jax.jit(prefill), jax.jit(step)


def generate(
    model: ModelConfig,
    variables: dict,
    prompt: Sequence[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """New token ids after `prompt` (ids), decoded with the latent KV cache; stops at `eos_id` (kept).

    `variables` are {'params', 'router'} (a Trainer's `variables`, `load_pretrained`'s second
    value). The token that lands at sequence position i is drawn with
    `jax.random.fold_in(jax.random.key(seed), i)`, so the same arguments give the same tokens.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    if isinstance(prompt, (str, bytes)) or not all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt
    ):
        raise UserError("the prompt must be token ids (integers); for text use generate_text or a tokenizer's encode")
    if not isinstance(variables, dict) or "params" not in variables:
        raise UserError(
            "variables: expected {'params', 'router'} (a Trainer's variables, load_pretrained's second value)"
        )
    prompt = [int(i) for i in prompt]
    if not prompt:
        raise UserError("the prompt is empty: give at least one token")
    if min(prompt) < 0 or max(prompt) >= model.vocab_size:
        raise UserError(f"prompt token ids must be in [0, {model.vocab_size}) (model.vocab_size)")
    length = len(prompt) + max_new_tokens
    if length > model.max_position_embeddings:
        raise UserError(
            f"{len(prompt)} prompt tokens + {max_new_tokens} new ones exceed "
            f"model.max_position_embeddings={model.max_position_embeddings}"
        )
    if max_new_tokens == 0:
        return []
    prefill, step = _programs(model, float(temperature), int(top_k), float(top_p))
    key = jax.random.key(seed)
    token, cache = prefill(variables, jnp.asarray([prompt], jnp.int32), init_cache(model, 1, length), key)
    out = []
    for position in range(len(prompt), length):
        out.append(int(token[0]))
        if out[-1] == eos_id or position == length - 1:
            break
        token, cache = step(variables, token, cache, jnp.int32(position), key)
    return out


def generate_text(model: ModelConfig, variables: dict, prompt: str | bytes, tokenizer=None, **sampling) -> str:
    """The continuation of `prompt` as text (default tokenizer: bytes); `sampling` as for `generate`."""
    if not isinstance(prompt, (str, bytes)):
        raise UserError(f"generate_text: the prompt must be text (str or bytes), not {type(prompt).__name__}")
    tokenizer = tokenizer or ByteTokenizer()
    prompt_ids = tokenizer.encode(prompt)
    new_ids = generate(model, variables, prompt_ids, eos_id=tokenizer.eos_id, **sampling)
    return continuation(tokenizer, prompt_ids, new_ids).decode("utf-8", errors="replace")


def continuation(tokenizer, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> bytes:
    """The bytes `new_ids` add after the prompt (decoded together, so merged tokens and spaces come out right)."""
    whole, head = tokenizer.decode(list(prompt_ids) + list(new_ids)), tokenizer.decode(prompt_ids)
    return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(new_ids)


# ----------------------------------------------------------------------------- command line


@contextlib.contextmanager
def _quiet_absl():
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


def build_parser() -> _Parser:
    parser = _Parser(prog="python -m maxmoe.generate", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run", type=path_argument, metavar="RUN_DIR", help="a training run folder (latest checkpoint, config.yaml)"
    )
    source.add_argument(
        "--checkpoint",
        type=path_argument,
        metavar="DIR",
        help="a converted checkpoint folder (from-hf) or an HF folder",
    )
    parser.add_argument("--prompt", required=True, help="text to continue (byte-level models: its UTF-8 bytes)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: all")
    parser.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this probability; 1: all")
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed of the draw (0 to 2**32-1): a seed repeats its text"
    )
    parser.add_argument("--tokenizer", default="", metavar="byte|PATH", help="default: the folder's or the run's")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    return parser


def checkpoint_step(folder: Path, args) -> str:
    """'<folder>, step N (the latest)': which step of a maxmoe checkpoint folder generate loads."""
    label = f"{'--run' if args.run else '--checkpoint'} {folder}"
    with latest_step_of(folder, label) as (_, step, _):
        return f"{folder}, step {step} (the latest)"


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    if not 0 <= args.seed < 2**32:  # jax.random.key keeps 32 bits: larger seeds repeat smaller ones
        raise UserError(f"--seed {args.seed}: expected 0 to {2**32 - 1}")
    folder = Path(args.run or args.checkpoint)
    if not folder.is_dir():
        raise UserError(f"{'--run' if args.run else '--checkpoint'} {folder}: no such folder")
    if args.run and not (folder / "config.yaml").is_file():
        raise UserError(f"--run {folder}: not a training run folder (no config.yaml); use --checkpoint for others")
    tokenizer = tokenizer_for(folder, args.tokenizer)
    if not (folder / "config.json").is_file():  # a maxmoe checkpoint, not Hugging Face weights
        print(f"maxmoe: loading {checkpoint_step(folder, args)}", file=sys.stderr, flush=True)
    runtime.use_compile_cache()
    try:
        with _quiet_absl():  # orbax's notes on read-only checkpoint managers
            config, variables = load_pretrained(folder, dtype="float32", compute_dtype=args.dtype)
    except ConfigError as e:
        raise UserError(f"{folder}: {e}") from None
    if tokenizer.vocab_size > config.model.vocab_size:
        raise UserError(
            f"the tokenizer's {tokenizer.vocab_size} tokens do not fit model.vocab_size={config.model.vocab_size}"
        )
    prompt = os.fsencode(args.prompt)  # the bytes as given, also when they are not UTF-8
    prompt_ids = tokenizer.encode(prompt)
    new_ids = generate(
        config.model,
        variables,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=tokenizer.eos_id,
    )
    out = sys.stdout.buffer
    out.write(prompt + continuation(tokenizer, prompt_ids, new_ids) + b"\n")
    out.flush()
    return 0


if __name__ == "__main__":
    exit_with(main())
