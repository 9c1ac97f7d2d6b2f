"""`python -m maxmoe.data prepare`: input formats, the eval split by tokens, parallel workers, vocab size."""

import gzip
import hashlib
import json

import numpy as np
import pytest
from test_data import assert_same_documents, rejoined, write_bpe_tokenizer

from maxmoe import data
from maxmoe.config import ConfigError, UserError, load_config
from maxmoe.data.__main__ import main as data_main
from maxmoe.data.documents import document_format, read_documents
from maxmoe.data.prepare import prepare_folder

TEXTS = [
    "plain ascii document one " * 9,
    "ünïcödé – second document ✓ " * 7,
    "third\nwith\nnewlines\n" * 11,
    "short",
    "fifth document, a little longer than the others " * 13,
]


def prepare(tmp_path, *extra):
    out = tmp_path / "tokens"
    assert data_main(["prepare", *extra, "--out", str(out), "--eval-fraction", "0.1", "--workers", "1"]) == 0
    return out


def test_jsonl_jsonl_gz_parquet_and_text_hold_the_same_documents(tmp_path):
    records = [{"id": i, "content": t} for i, t in enumerate(TEXTS)]
    lines = "".join(json.dumps(r) + "\n" for r in records[:3]) + "\n" + json.dumps({"content": None}) + "\n"
    (tmp_path / "a.jsonl").write_text(lines)  # a blank line and a null text: no documents
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records[3:]))
    out = prepare(tmp_path / "json", "--input", str(tmp_path / "*.jsonl*"), "--text-key", "content")
    assert_same_documents(out, TEXTS)
    assert data.read_meta(out)["splits"]["train"]["documents"] >= 4  # one per record, not one per file

    pa = pytest.importorskip("pyarrow", reason="pyarrow is in the test extra")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(TEXTS))), "content": TEXTS})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=2)  # rows across several row groups
    out = prepare(tmp_path / "parquet", "--input", str(tmp_path / "c.parquet"), "--text-key", "content")
    assert_same_documents(out, TEXTS)

    (tmp_path / "txt").mkdir()
    for i, text in enumerate(TEXTS):
        (tmp_path / "txt" / f"{i}.txt").write_text(text)
    out = prepare(tmp_path / "text", "--input", str(tmp_path / "txt" / "*.txt"))
    assert_same_documents(out, TEXTS)


def test_document_names_are_files_lines_and_rows(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "x"}\n\n{"text": "y"}\n')
    assert list(read_documents(str(path))) == [(f"{path}:1", "x"), (f"{path}:3", "y")]
    assert document_format("A.JSONL.GZ") == "jsonl" and document_format("a.md") == "text"


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "ok"}\n{"body": "no text key"}\n', r"a\.jsonl:2: no key 'text' \(found: body\)"),
        ('{"text": "ok"}\nnot json\n', r"a\.jsonl:2: not a valid JSON line"),
        ('{"text": 3}\n', r"a\.jsonl:1: 'text' holds a int"),
    ],
)
def test_bad_records_are_one_line_errors(tmp_path, content, match):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(UserError, match=match):
        data_main.__wrapped__(["prepare", "--input", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_missing_parquet_column_names_the_columns(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is in the test extra")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"no column 'text' \(found: body\)"):
        data_main.__wrapped__(["prepare", "--input", str(tmp_path / "a.parquet"), "--out", str(tmp_path / "o")])


def test_eval_share_follows_tokens_not_files(tmp_path):
    # Two files, one 30x the other: a split by file count would hold out half the files.
    (tmp_path / "big.txt").write_text("b" * 30_000)
    (tmp_path / "small.txt").write_text("s" * 1_000)
    out = tmp_path / "tokens"
    assert data_main(["prepare", "--input", str(tmp_path / "*.txt"), "--out", str(out), "--workers", "1"]) == 0
    meta = data.read_meta(out)
    held = meta["splits"]["eval"]
    assert held["tokens"] - held["documents"] == round(0.05 * 31_000)  # the share, to the token (EOS aside)
    assert_same_documents(out, ["b" * 30_000, "s" * 1_000])


def test_eval_split_takes_whole_documents_in_hash_order_and_cuts_one():
    rng = np.random.default_rng(0)
    names = [f"doc{i}" for i in range(200)]
    lengths = [int(x) for x in rng.integers(1, 5_000, len(names))]
    held = data.eval_split(names, lengths, 0.1)
    assert sum(held.values()) == round(0.1 * sum(lengths))
    order = sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).hexdigest())
    taken = [i for i in order if i in held]
    assert taken == order[: len(taken)]  # a prefix of the hash order
    assert all(held[i] == lengths[i] for i in taken[:-1]) and 0 < held[taken[-1]] <= lengths[taken[-1]]
    assert data.eval_split(["only"], [1000], 0.05) == {0: 50}  # one document: its last 5%
    with pytest.raises(UserError, match="eval_fraction"):
        data.eval_split(names, lengths, 1.0)


def test_folders_do_not_depend_on_the_number_of_workers(tmp_path):
    files = []
    for i, text in enumerate(TEXTS * 3):
        path = tmp_path / f"{i:02d}.txt"
        path.write_text(f"{i} {text}")
        files.append(str(path))
    # Chunks of ~100 characters: many tasks, so two worker processes really share the work.
    one = prepare_folder(tmp_path / "one", files, workers=1, chunk_chars=100, eval_fraction=0.2)
    two = prepare_folder(tmp_path / "two", files, workers=2, chunk_chars=100, eval_fraction=0.2)
    assert one == two
    for name in ("train.bin", "eval.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    train, held_out = rejoined(tmp_path / "one")
    assert len(train) + len(held_out) >= len(files)


def test_vocab_size_auto_takes_the_data_vocabulary(tmp_path):
    tokenizer, texts = write_bpe_tokenizer(tmp_path / "tokenizer.json")
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    out = tmp_path / "tokens"
    argv = ["prepare", "--input", str(tmp_path / "*.txt"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert data_main([*argv, "--out", str(out)]) == 0
    auto = load_config(overrides=["model.vocab_size=auto", "data.source=shards", f"data.path={out}"])
    assert auto.model.vocab_size == "auto"
    assert data.resolve_vocab_size(auto).model.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    stdlib = load_config(overrides=["model.vocab_size=auto"])
    assert data.resolve_vocab_size(stdlib).model.vocab_size == data.BYTE_VOCAB_SIZE
    with pytest.raises(ConfigError, match="synthetic needs a number"):
        data.resolve_vocab_size(load_config(overrides=["model.vocab_size=auto", "data.source=synthetic"]))
    with pytest.raises(ConfigError, match="expected an integer or auto"):
        load_config(overrides=["model.vocab_size=big"])
