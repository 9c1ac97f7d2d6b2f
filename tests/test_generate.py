"""Decoding with MLA's latent KV cache and `python -m maxmoe.generate`.

Oracles: transformers' logits for the golden DeepSeek-V3 fixture (tests/fixtures), and
decoding without a cache, where every new token runs the training model's full forward
over the whole sequence (`maxmoe.model.logits`).
"""

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import job_env
from tokenizers import Tokenizer, models, pre_tokenizers

from maxmoe import generate as gen
from maxmoe.config import load_config
from maxmoe.convert import hf
from maxmoe.model import logits as full_logits
from maxmoe.model.decode import decode, init_cache
from maxmoe.model.transformer import init_variables
from maxmoe.training.checkpoint import save_params

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hf_tiny_deepseek_v3"
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def fixture_model():
    config, variables = hf.load_pretrained(FIXTURE, dtype="float32")
    return config.model, variables, np.load(FIXTURE / "logits.npz")


@functools.partial(jax.jit, static_argnums=0)
def last_logits(model, variables, tokens_BT, position):
    return jax.lax.dynamic_index_in_dim(full_logits(model, variables, tokens_BT), position, axis=1, keepdims=False)


def uncached(model, variables, prompt, new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0):
    """Tokens from the full forward over the whole sequence at every step (no cache).

    The sequence sits in a zero-padded buffer of the final length, so one program serves
    every step: attention is causal and experts see one token at a time, so what follows a
    position does not change its logits.
    """
    key, tokens = jax.random.key(seed), np.zeros((1, len(prompt) + new_tokens), np.int32)
    tokens[0, : len(prompt)] = prompt
    for position in range(len(prompt), tokens.shape[1]):
        last = last_logits(model, variables, tokens, position - 1)
        tokens[0, position] = int(
            gen.sample_token(last, jax.random.fold_in(key, position), temperature, top_k, top_p)[0]
        )
    return tokens[0, len(prompt) :].tolist()


def test_cached_logits_match_transformers(fixture_model):
    model, variables, golden = fixture_model
    tokens = jnp.asarray(golden["tokens"])
    step = jax.jit(lambda v, t, c, s: decode(model, v, t, c, s))
    # The prompt in one pass, then one token at a time through the cache.
    logits, cache = step(variables, tokens[:, :5], init_cache(model, 2, 12), 0)
    pieces = [logits]
    for position in range(5, 12):
        logits, cache = step(variables, tokens[:, position : position + 1], cache, position)
        pieces.append(logits)
    # The bound test_convert uses for the uncached forward against the same golden file (float32 through
    # 3 layers with logits of size ~10; transformers sums in its own order).
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), golden["logits"], rtol=0, atol=1e-4)
    # The cache holds, per layer and position, the latent and one rope key: nothing per head.
    assert {k: v.shape for k, v in cache["moe_layers"].items()} == {"latent": (2, 2, 12, 16), "rope_key": (2, 2, 12, 4)}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3}])
def test_cached_and_uncached_decoding_give_the_same_tokens(fixture_model, sampling):
    model, variables, golden = fixture_model
    prompt = [int(t) for t in golden["tokens"][0, :6]]
    cached = gen.generate(model, variables, prompt, max_new_tokens=24, **sampling)
    assert len(cached) == 24
    assert cached == uncached(model, variables, prompt, 24, **sampling)
    assert cached == gen.generate(model, variables, prompt, max_new_tokens=24, **sampling)
    if sampling:  # another seed draws another sequence
        assert cached != gen.generate(model, variables, prompt, max_new_tokens=24, **{**sampling, "seed": 4})


def test_sampling_draws_from_the_top_k_and_top_p_sets():
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None]
    keys = jax.random.split(jax.random.key(0), 4000)

    def frequencies(**cut):
        draws = jax.vmap(lambda k: gen.sample_token(logits, k, **cut)[0])(keys)
        return np.bincount(np.asarray(draws), minlength=5) / len(keys)

    def renormalised(kept):
        expected = np.where(np.isin(np.arange(5), kept), probs, 0.0)
        return expected / expected.sum()

    # 4,000 draws: a frequency's standard deviation is at most 0.008; 0.04 is five of them.
    np.testing.assert_allclose(frequencies(temperature=1.0, top_k=0, top_p=1.0), probs, atol=0.04)
    np.testing.assert_allclose(frequencies(temperature=1.0, top_k=2, top_p=1.0), renormalised([1, 3]), atol=0.04)
    # top-p 0.8: 0.4 + 0.3 = 0.7 is short of it, so the third most likely (0.15) is kept too.
    np.testing.assert_allclose(frequencies(temperature=1.0, top_k=0, top_p=0.8), renormalised([1, 3, 4]), atol=0.04)
    np.testing.assert_allclose(frequencies(temperature=1.0, top_k=0, top_p=0.3), renormalised([1]), atol=0)
    assert int(gen.sample_token(logits, keys[0], 0.0, 0, 1.0)[0]) == 1  # temperature 0: argmax


def word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json: 'w2' ... 'w63' plus DeepSeek-V3's BOS (0) and EOS (1)."""
    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(vocab)[:2])  # as in the release: left out of decoded text
    tokenizer.save(str(path))


def run_generate(*args):
    env = job_env()
    return subprocess.run(
        [sys.executable, "-m", "maxmoe.generate", *args], capture_output=True, env=env, cwd=ROOT, timeout=600
    )


def test_generate_command_on_a_converted_checkpoint(fixture_model, tmp_path):
    model, variables, golden = fixture_model
    # A Hugging Face folder with a tokenizer, converted: from-hf carries the tokenizer along.
    hf_dir = tmp_path / "hf"
    shutil.copytree(FIXTURE, hf_dir)
    word_tokenizer(hf_dir / "tokenizer.json", model.vocab_size)
    hf.convert_from_hf(hf_dir, tmp_path / "converted")
    assert (tmp_path / "converted" / "tokenizer.json").is_file()
    prompt_ids = [int(t) for t in golden["tokens"][0, :6]]  # the shapes of the test above: its programs
    assert min(prompt_ids) >= 2  # words, not the specials
    expected = uncached(model, variables, prompt_ids, 24)
    if 1 in expected:  # the EOS token ends generation
        expected = expected[: expected.index(1)]
    prompt = " ".join(f"w{i}" for i in prompt_ids)
    result = run_generate(
        "--checkpoint", str(tmp_path / "converted"), "--prompt", prompt, "--max-new-tokens", "24", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == " ".join([prompt] + [f"w{i}" for i in expected]) + "\n"


def test_generate_command_on_a_byte_level_run(tmp_path, capsysbinary):
    # A training run folder of a small byte-level model: one MoE layer.
    small = {"model.num_layers": 1, "model.first_k_dense": 0, "model.mtp_num_layers": 0}
    config = load_config(TINY, {**small, "run.dir": str(tmp_path / "run")})
    variables = nn.unbox(init_variables(config.model, jax.random.key(7)))
    variables = jax.tree.map(lambda x: x * 8, variables)  # random, but with decisive logits
    save_params(tmp_path / "run", variables["params"], variables["router"], config)
    (tmp_path / "run" / "config.yaml").write_text(config.to_yaml())
    prompt = "import os"
    expected = gen.generate(config.model, variables, list(prompt.encode()), max_new_tokens=10, eos_id=gen.EOS_ID)
    # In this process: the programs compiled above serve the command too.
    assert (
        gen.main(["--run", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "10", "--temperature", "0"])
        == 0
    )
    # The prompt and the output are bytes; EOS (257) ends a document and is not printed.
    captured = capsysbinary.readouterr()
    assert captured.out == prompt.encode() + bytes(i for i in expected if i < 256) + b"\n"
    assert captured.err.decode() == f"maxmoe: loading {tmp_path / 'run'}, step 0 (the latest)\n"  # on stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--run", "/nonexistent/run", "--prompt", "x"], "no such folder"),
        (["--checkpoint", str(FIXTURE), "--prompt", "x"], "no tokenizer"),
        (["--checkpoint", str(FIXTURE), "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--checkpoint", str(FIXTURE), "--prompt", "x", "--top-p", "0"], "top_p"),
        (["--checkpoint", str(FIXTURE), "--prompt", "x", "--tokenizer", "/nonexistent.json"], "--tokenizer"),
        (["--prompt", "x"], "--run"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, words):
    assert gen.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxmoe: error: ") and words in err[0], err


def test_too_long_a_generation_is_refused_before_any_work(fixture_model):
    model, variables, _ = fixture_model
    with pytest.raises(gen.UserError, match="max_position_embeddings=64"):
        gen.generate(model, variables, [3] * 60, max_new_tokens=5)
