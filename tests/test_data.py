"""Data pipeline: determinism, process slicing, resume, the stdlib corpus, token folders, errors."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxmoe import data
from maxmoe.config import UserError, load_config
from maxmoe.data import token_folder
from maxmoe.data.__main__ import main as data_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    """A private stdlib cache, built once for the module (about 0.3 s)."""
    cache = tmp_path_factory.mktemp("stdlib-cache")
    data.stdlib_corpus(str(cache), 0.05)
    return str(cache)


def config(*overrides, **data_keys):
    items = [f"data.{k}={v}" for k, v in data_keys.items()]
    return load_config(overrides=["train.batch_size=8", "train.seq_len=32", *items, *overrides])


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def assert_resumes_and_slices(cfg, count=2):
    """A saved position resumes the same batches, also split over two processes."""
    iterator = data.make_dataset(cfg)
    take(iterator, 3)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = take(iterator, count)
    resumed = data.make_dataset(cfg)
    resumed.set_state(state)
    np.testing.assert_array_equal(np.stack(take(resumed, count)), np.stack(expected))
    # A restart with another process count continues the same global stream.
    halves = [data.make_dataset(cfg, process_index=p, process_count=2) for p in range(2)]
    for half in halves:
        half.set_state(state)
    np.testing.assert_array_equal(np.concatenate([next(h) for h in halves]), expected[0])
    return iterator, resumed


def write_bpe_tokenizer(path):
    """A small BPE tokenizer.json trained on repeated words, with `</s>` as its EOS; returns it."""
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is in the test extra")
    from tokenizers import models, pre_tokenizers, trainers

    texts = [f"alpha beta gamma delta {i} " * 30 for i in range(6)]
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"]))
    tokenizer.save(str(path))
    return tokenizer, texts


def source_configs(stdlib_cache):
    return [config(source="synthetic"), config(source="stdlib", cache_dir=stdlib_cache)]


def test_batches_have_the_promised_shape_and_range(stdlib_cache):
    for cfg in source_configs(stdlib_cache):
        batch = next(data.make_dataset(cfg, process_index=1, process_count=4))
        assert batch.shape == (2, 33) and batch.dtype == np.int32
        assert batch.min() >= 0 and batch.max() < data.vocab_size_of(cfg) <= cfg.model.vocab_size


def test_same_seed_same_batches_other_seed_other_batches(stdlib_cache):
    for cfg in source_configs(stdlib_cache):
        first = take(data.make_dataset(cfg), 3)
        again = take(data.make_dataset(cfg), 3)
        other = take(data.make_dataset(cfg.replace(train=dataclasses.replace(cfg.train, seed=1))), 3)
        np.testing.assert_array_equal(np.stack(first), np.stack(again))
        assert not np.array_equal(np.stack(first), np.stack(other))
        assert not np.array_equal(first[0], first[1])  # the stream moves on


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(stdlib_cache, process_count):
    for cfg in source_configs(stdlib_cache) + [config("train.eval_batches=3", source="stdlib", cache_dir=stdlib_cache)]:
        for split in ("train", "eval"):
            whole = take(data.make_dataset(cfg, split=split), 3)
            parts = [
                take(data.make_dataset(cfg, split=split, process_index=p, process_count=process_count), 3)
                for p in range(process_count)
            ]
            for step in range(3):
                np.testing.assert_array_equal(np.concatenate([part[step] for part in parts]), whole[step])


def test_resume_from_state_sees_the_same_batches(stdlib_cache):
    for cfg in source_configs(stdlib_cache):
        _, resumed = assert_resumes_and_slices(cfg)
        with pytest.raises(UserError):
            resumed.set_state({"split": "train", "step": -1})


def test_eval_batches_are_fixed_finite_and_seed_independent(stdlib_cache):
    cfg = config("train.eval_batches=3", source="stdlib", cache_dir=stdlib_cache)
    batches = list(data.make_dataset(cfg, split="eval"))
    assert len(batches) == 3
    reseeded = cfg.replace(train=dataclasses.replace(cfg.train, seed=7))
    np.testing.assert_array_equal(np.stack(batches), np.stack(list(data.make_dataset(reseeded, split="eval"))))
    eval_rows = {row.tobytes() for batch in batches for row in batch}
    train_rows = {row.tobytes() for batch in take(data.make_dataset(cfg), 50) for row in batch}
    assert not eval_rows & train_rows  # eval windows come from held-out documents


def split_documents(tokens):
    """Documents of a token stream in which each document ends with EOS."""
    ends = np.flatnonzero(np.asarray(tokens) == data.EOS_ID)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [data.decode_bytes(tokens[s:e]) for s, e in zip(starts, ends)]


def test_stdlib_corpus_decodes_to_the_stdlib_sources_with_disjoint_splits(stdlib_cache):
    root, names = data.stdlib_files()
    assert names == sorted(names) and all(n.endswith(".py") for n in names)
    assert not any({"site-packages", "test", "tests"} & set(Path(n).parts) for n in names)
    folder = data.stdlib_corpus(stdlib_cache, 0.05)  # cached: same folder, nothing rebuilt
    assert folder.parent == Path(stdlib_cache) and folder.name.startswith(f"stdlib-{sys.version_info[0]}.")
    sources = [(name, (root / name).read_bytes()) for name in names]
    sources = [(name, source) for name, source in sources if source]  # empty files hold no document
    held = data.eval_split([n for n, _ in sources], [len(s) for _, s in sources], 0.05)
    expected = {"train": [], "eval": []}
    for index, (_, source) in enumerate(sources):
        cut = len(source) - held.get(index, 0)
        for split, part in (("train", source[:cut]), ("eval", source[cut:])):
            if part:
                expected[split].append(part)
    for split in ("train", "eval"):
        tokens, meta = data.load_tokens(folder, split)
        assert tokens.dtype == np.uint16 and tokens.max() < data.BYTE_VOCAB_SIZE
        assert split_documents(tokens) == expected[split]
        assert meta["splits"][split]["documents"] == len(expected[split])
    assert expected["eval"] and not set(expected["eval"]) & set(expected["train"])
    # A training row is a slice of the stream: decoded, it is Python source text.
    row = next(data.make_dataset(config(source="stdlib", cache_dir=stdlib_cache)))[0]
    assert data.decode_bytes(row).decode("utf-8", errors="replace")


def test_vocab_checks(stdlib_cache):
    assert data.vocab_size_of(config(source="stdlib", cache_dir=stdlib_cache)) == 260
    with pytest.raises(UserError, match="model.vocab_size=256"):
        data.make_dataset(config("model.vocab_size=256", source="stdlib", cache_dir=stdlib_cache))


def write_corpus(folder, texts):
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"doc{i:02d}.txt").write_text(text)
    return str(folder / "*.txt")


def rejoined(folder):
    """The documents of a byte-level token folder, the one cut by the eval split put back together."""
    train = split_documents(data.load_tokens(folder, "train")[0])
    held_out = split_documents(data.load_tokens(folder, "eval")[0])
    return train, held_out


def assert_same_documents(folder, texts):
    """Every text is in train or eval whole, except at most one: its head in train, its tail in eval."""
    expected = [t.encode() if isinstance(t, str) else t for t in texts if t]
    train, held_out = rejoined(folder)
    pieces = [d for d in train + held_out if d not in expected]
    if pieces:
        head = next(d for d in train if d not in expected)
        tail = next(d for d in held_out if d not in expected)
        assert len(pieces) == 2 and head + tail in expected, pieces
        train, held_out = [d for d in train if d != head] + [head + tail], [d for d in held_out if d != tail]
    assert sorted(train + held_out) == sorted(expected)


def test_shards_round_trip_through_the_prepare_cli(tmp_path, capsys):
    texts = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (20 + i) for i in range(12)]
    pattern = write_corpus(tmp_path / "in", texts)
    out = tmp_path / "tokens"
    assert (
        data_main(["prepare", "--input", pattern, "--tokenizer", "byte", "--out", str(out), "--eval-fraction", "0.2"])
        == 0
    )
    assert "train" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 260 and meta["dtype"] == "uint16"
    total = sum(len(t) for t in texts)
    eval_split = meta["splits"]["eval"]
    assert eval_split["tokens"] - eval_split["documents"] == round(0.2 * total)  # EOS after each part
    assert meta["token_count"] == total + eval_split["documents"] + meta["splits"]["train"]["documents"]
    assert_same_documents(out, texts)
    cfg = config(source="shards", path=out)
    batch = next(data.make_dataset(cfg))
    assert batch.shape == (8, 33)
    for row in batch:
        pieces = data.decode_bytes(row).decode()
        assert any(pieces in text for text in texts) or data.EOS_ID in row
    assert data.vocab_size_of(cfg) == 260
    assert data_main(["stats", "--path", str(out)]) == 0


def test_prepare_with_a_tokenizer_json(tmp_path):
    tokenizer, texts = write_bpe_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "tokens"
    assert (
        data_main(
            [
                "prepare",
                "--input",
                write_corpus(tmp_path / "in", texts),
                "--tokenizer",
                str(tmp_path / "tokenizer.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    meta = data.read_meta(out)
    eos = tokenizer.token_to_id("</s>")
    assert meta["eos_id"] == eos and meta["vocab_size"] == tokenizer.get_vocab_size()
    tokens = np.concatenate([data.load_tokens(out, s)[0] for s in ("train", "eval")])
    ends = np.flatnonzero(tokens == eos)
    first = tokenizer.decode(tokens[: ends[0]].tolist())  # BPE pieces come back space-separated
    # The first train document, whole or (cut by the eval split) its head.
    assert any("".join(text.split()).startswith("".join(first.split())) for text in texts)
    assert len(first.split()) > 20
    cfg = config("model.vocab_size=80", "train.seq_len=8", source="shards", path=out)
    assert next(data.make_dataset(cfg)).max() < meta["vocab_size"]


def test_bad_data_raises_one_line_user_errors(tmp_path):
    out = tmp_path / "tokens"
    data_main(["prepare", "--input", write_corpus(tmp_path / "in", ["abc " * 50, "def " * 50]), "--out", str(out)])
    # A folder of text is tokenised (maxmoe.data.text_cache); one with neither meta.json nor text is refused.
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "weights.bin").write_bytes(b"\0" * 8)
    cases = {
        "missing folder": config(source="shards", path=tmp_path / "nowhere"),
        "not a token folder": config(source="shards", path=tmp_path / "neither"),
        "windows too long": config(
            "train.seq_len=5000", "model.max_position_embeddings=8192", source="shards", path=out
        ),
    }
    with pytest.raises(UserError, match="data.eval_fraction=1.5: must be below 1"):  # the config's own check now
        config(source="stdlib", eval_fraction=1.5, cache_dir=tmp_path / "c")
    for why, cfg in cases.items():
        with pytest.raises(UserError) as error:
            data.make_dataset(cfg)
        assert "\n" not in str(error.value), why
    with pytest.raises(UserError, match="not divisible"):
        data.make_dataset(config(source="synthetic"), process_count=3)
    meta = json.loads((out / "meta.json").read_text())
    for broken, match in [
        ({**meta, "dtype": "float32"}, "dtype"),
        ({**meta, "vocab_size": 70000}, "does not fit"),
        ({**meta, "splits": {**meta["splits"], "train": {**meta["splits"]["train"], "tokens": 3}}}, "promises"),
    ]:
        (out / "meta.json").write_text(json.dumps(broken))
        with pytest.raises(UserError, match=match):
            data.make_dataset(config(source="shards", path=out))
    (out / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        data.read_meta(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(UserError, match="empty corpus"):
        data_main.__wrapped__(["prepare", "--input", str(empty / "*.txt"), "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists() and not list(tmp_path.glob(".e.tmp-*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["prepare", "--input", "/nonexistent/*.txt", "--out", "D"],
        ["prepare", "--input", "x", "--tokenizer", "/no/tokenizer.json", "--out", "D"],
        ["stats", "--path", "/nonexistent"],
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path, argv):
    argv = [str(tmp_path / a) if a == "D" else a for a in argv]
    if argv[2] == "x":
        write_corpus(tmp_path / "in", ["text"])
        argv[2] = str(tmp_path / "in" / "*.txt")
    result = subprocess.run(
        [sys.executable, "-m", "maxmoe.data", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert result.stderr.startswith("maxmoe: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "D").exists()


def letter_folder(tmp_path, letter, documents=6):
    """A byte-level token folder whose documents are all `letter`: its rows say where they came from."""
    source = tmp_path / f"in-{letter}"
    source.mkdir()
    for i in range(documents):
        (source / f"{i}.txt").write_text(letter * (400 + 37 * i))
    out = tmp_path / f"tokens-{letter}"
    assert data_main(["prepare", "--input", str(source / "*.txt"), "--out", str(out), "--workers", "1"]) == 0
    return out


def row_letters(batch):
    """The letter of each row (rows hold one letter and EOS only)."""
    letters = []
    for row in batch:
        text = set(data.decode_bytes(row).decode())
        assert len(text) == 1, text
        letters.append(text.pop())
    return letters


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("mixture")
    return letter_folder(tmp_path, "a"), letter_folder(tmp_path, "b")


@pytest.mark.parametrize("weights, per_window", [((3, 1), (6, 2)), ((0.7, 0.3), (56, 24))])
def test_two_folder_mixture_has_exact_proportions(two_folders, weights, per_window):
    a, b = two_folders
    cfg = config(source="shards", mixture=f"{{{a}: {weights[0]}, {b}: {weights[1]}}}")
    batches = take(data.make_dataset(cfg), 20)
    # 3:1 over batches of 8: 6 and 2 in every batch; 0.7:0.3: 56 and 24 in every 10 batches of 8.
    window = 1 if per_window == (6, 2) else 10
    for start in range(0, len(batches), window):
        letters = [x for batch in batches[start : start + window] for x in row_letters(batch)]
        assert (letters.count("a"), letters.count("b")) == per_window
    # Each folder is read as its own shuffled stream: the rows of folder a are the rows a
    # one-folder run of folder a reads, in the same order.
    alone = take(data.make_dataset(config(source="shards", path=a)), 20)
    from_a = [row for batch in batches for row in batch if row_letters([row]) == ["a"]]
    np.testing.assert_array_equal(np.stack(from_a), np.concatenate(alone)[: len(from_a)])


def test_mixture_resumes_and_slices_by_process(two_folders):
    a, b = two_folders
    cfg = config(source="shards", mixture=f"{{{a}: 2, {b}: 1}}")
    iterator, _ = assert_resumes_and_slices(cfg, count=3)
    assert "mixture of 66.7%" in iterator.description


def test_mixture_sources_read_each_folder_in_order():
    weights = [0.5, 0.2, 0.3]
    ids = np.arange(1000)
    sources, indices = data.mixture_sources(ids, weights)
    for source, weight in enumerate(weights):
        mine = indices[sources == source]
        np.testing.assert_array_equal(mine, np.arange(len(mine)))  # no sample skipped or read twice
        prefix_counts = np.cumsum(sources == source)
        assert np.abs(prefix_counts - (ids + 1) * weight).max() <= 1.0  # every prefix within one sample
    # Random access: any slice gives what the whole stream gives.
    part = data.mixture_sources(ids[337:512], weights)
    np.testing.assert_array_equal(part[0], sources[337:512])
    np.testing.assert_array_equal(part[1], indices[337:512])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["data.source=shards"], "data.path .* or data.mixture"),
        (["data.source=shards", "data.path=x", "data.mixture={y: 1}"], "both given"),
        (["data.source=shards", "data.mixture={y: 0}"], "positive number"),
        (["data.source=shards", "data.mixture={y: two}"], "positive number"),
    ],
)
def test_mixture_config_errors(overrides, match):
    with pytest.raises(UserError, match=match):
        load_config(overrides=overrides)


def test_shard_files_must_lie_inside_their_folder(tmp_path):
    out = tmp_path / "tokens"
    data_main(["prepare", "--input", write_corpus(tmp_path / "in", ["abc " * 50, "def " * 50]), "--out", str(out)])
    meta = json.loads((out / "meta.json").read_text())
    outside = tmp_path / "outside.bin"
    outside.write_bytes((out / "train.bin").read_bytes())  # a file that would otherwise read fine
    for name in ("../outside.bin", str(outside), "sub/train.bin", "..", ""):
        splits = {**meta["splits"], "train": {**meta["splits"]["train"], "file": name}}
        (out / "meta.json").write_text(json.dumps({**meta, "splits": splits}))
        with pytest.raises(UserError, match="expected a file name inside the folder") as error:
            data.make_dataset(config(source="shards", path=out))
        assert repr(name) in str(error.value) and "\n" not in str(error.value)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, monkeypatch):
    out = tmp_path / "tokens"
    data_main(["prepare", "--input", write_corpus(tmp_path / "in", ["abc " * 50, "def " * 50]), "--out", str(out)])
    cfg = config("train.seq_len=8", source="shards", path=out)
    assert next(data.make_dataset(cfg)).max() < 260
    tokens = np.fromfile(out / "train.bin", dtype="<u2")
    tokens[17] = 300  # meta.json still says vocab_size 260: the embedding lookup would give NaN
    # Replaced, not rewritten in place: the first dataset's read-ahead threads may still be reading it.
    tokens.tofile(out / "train.bin.new")
    os.replace(out / "train.bin.new", out / "train.bin")
    with pytest.raises(UserError) as error:
        data.make_dataset(cfg)
    assert str(error.value) == (
        f"{out / 'train.bin'}: token id 300 is outside the vocabulary of 260 (meta.json vocab_size); "
        f"the folder was written with another tokenizer or is damaged"
    )
    # The scan runs once per file: later loads (every evaluation reopens its split) reuse it.
    scans = []
    real = token_folder.TokenFile.max
    monkeypatch.setattr(token_folder.TokenFile, "max", lambda self: scans.append(1) or real(self))
    for _ in range(3):
        data.load_tokens(out, "eval")
    assert len(scans) == 1  # the eval file is small: one block


def test_an_unwritable_cache_dir_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError) as error:
        data.make_dataset(config(source="stdlib", cache_dir=blocker / "cache"))
    message = str(error.value)
    assert message.startswith(f"data.cache_dir={blocker / 'cache'}: cannot build the stdlib token cache (")
    assert "\n" not in message
