"""Reading a Triton-style model repository from disk.

```
REPO/<model>/config.yaml            optional; completed from the model file when absent
REPO/<model>/<version>/model.<ext>  version directories are positive integers
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from slipstream.config import ConfigError, ModelConfig, parse_model_config
from slipstream.runtime import MODEL_EXTENSIONS

CONFIG_FILENAMES = ("config.yaml", "config.yml")


@dataclass(frozen=True, slots=True)
class ModelDirectory:
    """One model's directory and what it holds right now."""

    name: str
    path: Path
    # Version numbers found on disk (before the version policy), ascending.
    versions: tuple[int, ...]


def list_models(repository: Path) -> dict[str, ModelDirectory]:
    """Every model directory in the repository, by name."""
    if not repository.is_dir():
        raise FileNotFoundError(f"model repository {repository} is not a directory")
    models = {}
    for entry in sorted(repository.iterdir()):
        if entry.is_dir() and not entry.name.startswith("."):
            models[entry.name] = read_model_directory(entry)
    return models


def read_model_directory(path: Path) -> ModelDirectory:
    # Change polling stamps the files itself (repository/changes.py): reading versions
    # only, a file vanishing mid-copy cannot fail the scan of the whole repository.
    versions = [
        int(entry.name)
        for entry in path.iterdir()
        if entry.name.isdigit() and int(entry.name) > 0 and entry.is_dir()
    ]
    return ModelDirectory(name=path.name, path=path, versions=tuple(sorted(versions)))


def read_config(model: ModelDirectory) -> ModelConfig:
    """The model's config.yaml, validated; an empty config when there is none."""
    for filename in CONFIG_FILENAMES:
        config_path = model.path / filename
        if config_path.is_file():
            source = f"{model.name}/{filename}"
            try:
                data = yaml.safe_load(config_path.read_text())
            except yaml.YAMLError as exc:
                raise ConfigError(f"{source}: not valid YAML: {exc}") from None
            config = parse_model_config(data, source)
            break
    else:
        config = ModelConfig()
    if config.name and config.name != model.name:
        raise ConfigError(
            f"{model.name}/config.yaml: name: {config.name!r} must match the directory name "
            f"{model.name!r} (or be left out)"
        )
    config.name = model.name
    return config


def is_generative(model: ModelDirectory) -> bool:
    """Whether the OpenAI lane (slipstream.llm) serves this model rather than the V2 lane."""
    try:
        return read_config(model).generative
    except ConfigError:
        return False


def named_model_file(version_dir: Path, config: ModelConfig) -> Path | None:
    """The file ``default_model_filename`` names (ConfigError if missing), or None."""
    if not config.default_model_filename:
        return None
    path = version_dir / config.default_model_filename
    if not path.exists():
        raise ConfigError(f"default_model_filename: {path} does not exist")
    return path


def model_file(version_dir: Path, config: ModelConfig) -> Path:
    """The model file inside a version directory."""
    named = named_model_file(version_dir, config)
    if named is not None:
        return named
    candidates = [
        p
        for p in sorted(version_dir.iterdir())
        if p.stem == "model" and p.suffix.lower() in MODEL_EXTENSIONS
    ]
    if not candidates:
        names = ", ".join(f"model{ext}" for ext in MODEL_EXTENSIONS)
        found = ", ".join(os.listdir(version_dir)) or "nothing"
        raise ConfigError(f"{version_dir}: expected one of {names}; found {found}")
    if len(candidates) > 1:
        raise ConfigError(
            f"{version_dir}: several model files ({', '.join(p.name for p in candidates)}); "
            "keep one or set default_model_filename"
        )
    return candidates[0]
