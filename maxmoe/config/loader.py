"""The whole configuration: YAML files merged in order over the defaults, then `section.key=value`
overrides, every value checked by its key's declaration and the sections' checks run.

    config = load_config(["configs/tiny.yaml"], ["train.steps=20"])
    config.replace(train={"steps": 50}); config.override("mesh.data=2")

Keys of earlier versions are refused in one line naming what replaces them; files maxmoe wrote
itself (a run's config.yaml) are read with them translated (`stored=True`).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from maxmoe.config.checkpoint import CheckpointConfig
from maxmoe.config.data import DataConfig, check_data
from maxmoe.config.dist import DistConfig, check_dist
from maxmoe.config.errors import ConfigError, read_named_file
from maxmoe.config.fields import check_extent, coerce, shown, type_name, unknown
from maxmoe.config.mesh import REMOVED_KEYS, MeshConfig, check_mesh
from maxmoe.config.model import ModelConfig, check_model, validate_model
from maxmoe.config.moe import MoEConfig, check_moe
from maxmoe.config.run import RunConfig, check_run
from maxmoe.config.train import TrainConfig, check_train
from maxmoe.config.xla import XlaConfig, check_xla
from maxmoe.config.yaml_reader import read_value, read_yaml


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole resolved configuration."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    xla: XlaConfig = dataclasses.field(default_factory=XlaConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)

    def replace(self, **sections) -> Config:
        """A validated copy with sections replaced: by section objects or by dicts of changed keys.

            config.replace(train={"steps": 50}, mesh=dataclasses.replace(config.mesh, data=2))

        Values are type-checked and cross-checked as `load_config` checks them (ConfigError).
        """
        raw = self.to_dict()
        for section, value in sections.items():
            if section not in SECTIONS:
                raise unknown(section, list(SECTIONS))
            if isinstance(value, SECTIONS[section]):
                raw[section] = dataclasses.asdict(value)
            elif isinstance(value, dict):
                _merge_section(section, raw[section], value, "replace")
            else:
                raise ConfigError(
                    f"replace({section}=...): expected a {SECTIONS[section].__name__} or a dict of its keys"
                )
        return build_config(raw)

    def override(self, *overrides: str) -> Config:
        """A validated copy with `section.key=value` overrides applied, as on the command line."""
        raw = self.to_dict()
        _apply_overrides(raw, overrides)
        return build_config(raw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
# Each section's checks, in the order a config is validated (a check may read other sections).
CHECKS = (check_model, check_moe, check_train, check_data, check_run, check_xla, check_dist, check_mesh)


def all_keys() -> list[str]:
    """Every key as `section.key`."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def describe_keys() -> str:
    """Every config key with its type, default and doc, section by section (the text of --help)."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"{section}: {(cls.__doc__ or '').strip()}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = typing.get_origin(hints[f.name]) or hints[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = yaml.safe_dump(default, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
            lines.append(f"  {section}.{f.name}: {type_name(kind, f.metadata)} = {shown}")
            if f.metadata.get("doc"):
                lines.append(f"      {f.metadata['doc']}")
        lines.append("")
    return "\n".join(lines)


def _removed(key: str, value: Any) -> ConfigError:
    """The one line for a key of an earlier version: what replaces it, and the value meaning the same."""
    replacement, meaning = REMOVED_KEYS[key]
    if replacement is None:
        return ConfigError(f"{key} was removed (it is how maxmoe always works now); delete it")
    same = meaning.get(value) if isinstance(value, bool) else None
    instead = f"{replacement}={same}" if same else f"{replacement} (or leave it out)"
    return ConfigError(f"{key} was removed; set {instead} instead")


def _merge_section(section: str, current: dict, updates: Any, source: str, stored: bool = False) -> None:
    if not isinstance(updates, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping of keys to values")
    names = {f.name for f in dataclasses.fields(SECTIONS[section])}
    for name, value in updates.items():
        key = f"{section}.{name}"
        check_extent(key, value)  # before anything reads it: an alias bomb or a cycle costs no more
        if key in REMOVED_KEYS:
            replacement, meaning = REMOVED_KEYS[key]
            translated = meaning.get(value) if isinstance(value, bool) else None
            if not stored:
                raise _removed(key, value)
            if translated is not None:
                current[replacement.split(".", 1)[1]] = translated
            continue
        if name not in names:
            raise unknown(key, all_keys())
        current[name] = value


def _is_text(section: Any, name: Any) -> bool:
    """Whether `section.name` is a text-typed key (its value keeps the text as written)."""
    cls = SECTIONS.get(section) if isinstance(section, str) else None
    if cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
        return False
    return typing.get_type_hints(cls)[name] is str


def load_config(
    files: str | Path | list | tuple = (),
    overrides: list[str] | tuple[str, ...] | dict[str, Any] = (),
    *,
    stored: bool = False,
) -> Config:
    """Merge YAML `files` in order over the defaults, apply overrides, validate.

    `files` is one path or a list of them (None: none); `overrides` a list of `section.key=value`
    strings (values read as YAML, as on the command line; one string is one override) or a
    dict {"section.key": value}. `stored`: the files are configs maxmoe wrote (a run's
    config.yaml): keys of earlier versions are translated, not refused.
    """
    raw: dict[str, dict] = {s: {} for s in SECTIONS}
    files = _config_paths(files)
    for path in files:
        text = read_named_file(path, "config file", error=ConfigError)
        try:
            doc = read_yaml(text.decode("utf-8"), str(path), _is_text) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a mapping of sections")
        for section, updates in doc.items():
            if section not in raw:
                raise unknown(str(section), list(SECTIONS))
            _merge_section(section, raw[section], updates, path, stored)
    _apply_overrides(raw, overrides)
    if files and "dir" not in raw["run"]:
        raw["run"]["dir"] = default_run_dir(files)
    return build_config(raw)


def default_run_dir(files: list) -> str:
    """run.dir when no file or override sets it: runs/<config file stem>, one folder per config.

    Several files give their stems joined by '+'; a file named config.yaml (what `convert
    from-hf` writes) is named by its folder.
    """
    names = [Path(f).parent.name or "config" if Path(f).stem == "config" else Path(f).stem for f in files]
    return "runs/" + "+".join(names)


def _config_paths(files: Any) -> list:
    """`load_config`'s files as a list of paths: None is none, one path is a list of one."""
    if files is None:
        return []
    if isinstance(files, (str, os.PathLike)):
        return [files]
    if isinstance(files, (list, tuple)) and all(isinstance(f, (str, os.PathLike)) for f in files):
        return list(files)
    raise ConfigError(f"config files {shown(files)}: expected a path or a list of paths")


def _apply_overrides(raw: dict[str, dict], overrides: Any) -> None:
    """Merge `section.key=value` strings (or a {"section.key": value} dict) into `raw`.

    None is no overrides; one string is one override.
    """
    if overrides is None:
        overrides = ()
    elif isinstance(overrides, str):
        overrides = (overrides,)
    elif not isinstance(overrides, (list, tuple, dict)):
        raise ConfigError(f"overrides {shown(overrides)}: expected a list of 'section.key=value' strings or a dict")
    if isinstance(overrides, dict):
        pairs = [(str(key), value, False) for key, value in overrides.items()]
    else:
        pairs = []
        for item in overrides:
            if not isinstance(item, str) or "=" not in item:
                raise ConfigError(f"override {shown(item)} is not of the form section.key=value")
            key, text = item.split("=", 1)
            pairs.append((key, text, True))
    for key, value, written in pairs:
        key = key.strip()
        if "." not in key:
            raise unknown(key, all_keys())
        section, name = key.split(".", 1)
        if section not in raw:
            raise unknown(key, all_keys())
        if written and not _is_text(section, name):  # a text key keeps the text as written
            value = read_value(value, key)
        if section == "mesh" and name.startswith("rules."):
            # mesh.rules.<logical>=[axes] changes one rule and keeps the others.
            name, value = "rules", {**raw["mesh"].get("rules", {}), name[len("rules.") :]: value}
        _merge_section(section, raw[section], {name: value}, "override")


def _build_section(section: str, values: dict) -> Any:
    """One section's dataclass from a dict of its keys, each type-checked."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    values = dict(values)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for name in values:
        if name not in known:
            raise unknown(f"{section}.{name}", all_keys())
    for name, value in list(values.items()):
        kind = typing.get_origin(hints[name]) or hints[name]
        values[name] = coerce(f"{section}.{name}", value, kind, known[name].metadata)
    return cls(**values)


def validate(config: Config) -> None:
    """Every section's checks (they need no devices; maxmoe.parallel.mesh checks the sizes again)."""
    for check in CHECKS:
        check(config)


def build_config(raw: dict[str, dict]) -> Config:
    """Type-check a nested dict of sections and build a validated Config."""
    for section in raw:
        if section not in SECTIONS:
            raise unknown(str(section), list(SECTIONS))
    config = Config(**{section: _build_section(section, raw.get(section, {})) for section in SECTIONS})
    validate(config)
    return config


def build_model_config(values: dict) -> ModelConfig:
    """A validated ModelConfig from the model keys alone (a converted or saved model)."""
    model = _build_section("model", values)
    validate_model(model)
    return model
