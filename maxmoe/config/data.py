"""data: where tokens come from, and which keys each source reads."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    source: str = field(
        "auto",
        choices=("auto", "stdlib", "synthetic", "shards"),
        doc="auto: shards when data.path or data.mixture is given, else stdlib; stdlib: the Python standard "
        "library as bytes; synthetic: random tokens; shards: data.path or data.mixture",
    )
    path: str = field(
        "",
        path=True,
        doc="a token folder (`python -m maxmoe.data prepare`), or text to tokenise once into data.cache_dir: "
        "a .txt/.jsonl/.jsonl.gz/.parquet file, a glob, or a folder of them",
    )
    mixture: dict = field(
        {}, path=True, doc="shards: several folders and their weights, {folder: weight, ...}, instead of data.path"
    )
    tokenizer: str = field("byte", path=True, doc="data.path text: 'byte' or a Hugging Face tokenizer.json")
    text_key: str = field("text", doc="data.path text: the field of .jsonl records and .parquet rows")
    cache_dir: str = field(
        "", path=True, doc="token cache of the stdlib corpus and of data.path text; empty: ~/.cache/maxmoe"
    )
    eval_fraction: float = field(0.05, gt=0, doc="stdlib and data.path text: share of tokens held out for eval")

    @property
    def kind(self) -> str:
        """The source in effect: data.source, with auto resolved (shards when a path or mixture is given)."""
        return source_in_effect(self.source, self.path, self.mixture)


def source_in_effect(source: str, path: Any, mixture: Any) -> str:
    """data.source with `auto` resolved: shards when a path or mixture is given, else stdlib (also
    for a stored config's values, which resume compares as the data they read)."""
    if source != "auto":
        return source
    return "shards" if path or mixture else "stdlib"


def check_data(config) -> None:
    """The keys the data source reads (`_validate_shards`) and a held-out share that leaves training data."""
    _validate_shards(config.data)
    if config.data.eval_fraction >= 1:
        raise ConfigError(
            f"data.eval_fraction={config.data.eval_fraction}: must be below 1 (training needs tokens too)"
        )


def _validate_shards(data: DataConfig) -> None:
    """data.path or data.mixture (one, not both) for data.source=shards; mixture weights are positive numbers.

    A path or mixture under a source that reads neither is refused, not ignored.
    """
    if data.kind != "shards":
        if data.path or data.mixture:
            given = f"data.path={data.path}" if data.path else "data.mixture"
            raise ConfigError(
                f"{given} is not read with data.source={data.source}; leave data.source out (auto) "
                f"or set data.source=shards to train on it"
            )
        return
    if data.path and data.mixture:
        raise ConfigError("data.path and data.mixture both given; use data.mixture alone for several folders")
    if not data.path and not data.mixture:
        raise ConfigError(
            "data.source=shards needs data.path (a folder made by `python -m maxmoe.data prepare`) "
            "or data.mixture ({folder: weight, ...})"
        )
    for folder, weight in data.mixture.items():
        if not isinstance(folder, str) or not folder:
            raise ConfigError(f"data.mixture: {folder!r} is not a folder path")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"data.mixture: weight {weight!r} of {folder}: expected a positive number")
