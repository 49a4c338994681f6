"""Reading a Triton-style model repository from disk.

```
REPO/<model>/config.yaml            optional; completed from the model file when absent
REPO/<model>/config.pbtxt           or Triton's (repository/triton_config.py)
REPO/<model>/<version>/model.<ext>  version directories are positive integers
```
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import yaml

from slipstream.config import ConfigError, ModelConfig, parse_model_config
from slipstream.errors import InvalidRequest, SlipstreamError
from slipstream.names import validate_model_name
from slipstream.repository.triton_config import (
    TRITON_CONFIG_FILENAME,
    parse_triton_config,
    parse_triton_json,
)
from slipstream.runtime import MODEL_EXTENSIONS, own_model_file

logger = logging.getLogger(__name__)

# Slipstream's own config files, which `tune --apply` writes and `export` copies.
CONFIG_FILENAMES = ("config.yaml", "config.yml")
# Every file a model's config is read from, in order: a config.yaml beside a Triton
# config.pbtxt wins (so Slipstream's keys can be added to a Triton repository).
CONFIG_FILES = (*CONFIG_FILENAMES, TRITON_CONFIG_FILENAME)
T = TypeVar("T")
# libyaml's safe loader where PyYAML was built with it (its wheels are): a model's
# config parses in 70 us instead of 500, and listing a repository reads every config
# (a 500-model repository's index took 0.68 s of the event loop with the Python loader).
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True, slots=True)
class ModelDirectory:
    """One model's directory and what it holds right now."""

    name: str
    path: Path
    # Version numbers found on disk (before the version policy), ascending.
    versions: tuple[int, ...]


def model_path(repository: Path, name: str) -> Path:
    """``repository / name`` once ``name`` is valid and the directory stays inside.

    The name is checked first (InvalidRequest naming the rule); then the path, symlinks
    resolved, must still lie inside the resolved repository, so a symlink out of the
    repository is refused too (InvalidRequest). The directory need not exist.
    """
    return _inside(repository, repository.resolve(), name)


def _inside(repository: Path, inside: Path, name: str) -> Path:
    """:func:`model_path` with the repository's resolved path given (a listing resolves
    it once, not once per model)."""
    validate_model_name(name)
    path = repository / name
    resolved = _resolve(path, f"model {name!r}")
    if resolved.parent != inside:
        raise InvalidRequest(
            f"model {name!r}: its directory resolves to {resolved}, outside the model "
            f"repository {inside}; a model directory must be a directory of the repository "
            "(replace the symlink with the model's files)"
        )
    return path


def contained_file(directory: Path, relative: str, field: str) -> Path:
    """``directory / relative`` for a file a config names; ConfigError if it leaves it.

    ``relative`` must be a relative path, and the file, symlinks resolved, must lie
    inside the resolved ``directory``. ``field`` names the config key in the message.
    """
    if "\x00" in relative:
        raise ConfigError(f"{field}: {relative!r} contains a NUL character; name a file")
    candidate = Path(relative)
    inside = directory.resolve()
    try:
        resolved = _resolve(directory / candidate, field)
    except InvalidRequest as exc:
        raise ConfigError(exc.message) from None
    if candidate.is_absolute() or not resolved.is_relative_to(inside):
        raise ConfigError(
            f"{field}: {relative!r} resolves to {resolved}, outside the model's directory "
            f"{inside}; name a file inside it, relative to it (e.g. tokenizer/tokenizer.json)"
        )
    return directory / candidate


def _resolve(path: Path, what: str) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop: RuntimeError before 3.13
        raise InvalidRequest(
            f"{what}: {path} cannot be resolved ({exc}); fix the symlink"
        ) from None


class Share(Protocol):
    """The part of the repository one process serves (repository/placement.py's
    :class:`~slipstream.repository.placement.Share`, one per engine process)."""

    def select(self, models: dict[str, ModelDirectory]) -> dict[str, ModelDirectory]: ...


# (directory, why) of the entries list_models skipped and said so.
_SKIPPED: set[tuple[Path, str]] = set()


def list_models(repository: Path, share: Share | None = None) -> dict[str, ModelDirectory]:
    """Every model directory in the repository, by name (those of ``share`` only, where
    one is given).

    Hidden directories are skipped silently; directories whose name is no valid model
    name, or that are symlinks out of the repository, are skipped with a warning.
    """
    if not repository.is_dir():
        raise FileNotFoundError(f"model repository {repository} is not a directory")
    models = {}
    inside = repository.resolve()
    for entry in sorted(repository.iterdir()):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        try:
            _inside(repository, inside, entry.name)
        except SlipstreamError as exc:
            # Every scan skips it (the V2 models', the generative ones', each poll):
            # said once, and again only once it was fixed and broke anew.
            if (entry, exc.message) not in _SKIPPED:
                _SKIPPED.add((entry, exc.message))
                logger.warning("skipping %s: %s", entry, exc.message)
            continue
        _SKIPPED.difference_update({k for k in _SKIPPED if k[0] == entry})
        models[entry.name] = read_model_directory(entry)
    return models if share is None else share.select(models)


def tensor_models(repository: Path, share: Share | None = None) -> dict[str, ModelDirectory]:
    """The models the V2 model manager loads from files: all of :func:`list_models` but
    the generative ones (slipstream.llm serves those) and the cascades
    (serving/cascade.py builds those from their stages)."""
    found = list_models(repository, share)
    return {name: d for name, d in found.items() if not (is_generative(d) or is_cascade(d))}


def read_model_directory(path: Path) -> ModelDirectory:
    # Change polling stamps the files itself (repository/changes.py): reading versions
    # only, a file vanishing mid-copy cannot fail the scan of the whole repository.
    versions = [
        number
        for entry in path.iterdir()
        if (number := version_number(entry.name)) is not None and entry.is_dir()
    ]
    return ModelDirectory(name=path.name, path=path, versions=tuple(sorted(versions)))


def version_number(name: str) -> int | None:
    """The version a directory ``name`` is, as Triton reads one: ASCII digits not starting
    with 0 (``007/``, ``0/``, a Unicode digit: not a version, ignored); None otherwise.

    >>> [version_number(n) for n in ("1", "12", "007", "0", "v1", "²")]
    [1, 12, None, None, None, None]
    """
    if name.isascii() and name.isdigit() and not name.startswith("0"):
        return int(name)
    return None


def read_config(model: ModelDirectory) -> ModelConfig:
    """The model's config.yaml (or config.pbtxt), validated; an empty config when there
    is none."""
    source = f"{model.name}/config.yaml"
    config = ModelConfig()
    for filename in CONFIG_FILES:
        if (model.path / filename).is_file():
            source = f"{model.name}/{filename}"
            config = parse_model_config(raw_config(model.path, filename), source)
            break
    if config.name and config.name != model.name:
        raise ConfigError(
            f"{source}: name: {config.name!r} must match the directory name "
            f"{model.name!r} (or be left out)"
        )
    _check_named_files(model.path, config)
    config.name = model.name
    return config


def load_override(repository: Path, name: str, text: str) -> ModelConfig:
    """The config a load request carries (Triton's ``config`` parameter: the model config
    in its JSON form), validated as the model's config file would be; InvalidRequest
    naming the field."""
    source = "parameters.config"
    path = model_path(repository, name)
    try:
        config = parse_model_config(parse_triton_json(text, source), source)
        if config.name and config.name != name:
            raise ConfigError(f"{source}: name: {config.name!r} must be {name!r} (or be left out)")
        _check_named_files(path, config)
    except ConfigError as exc:
        raise InvalidRequest(str(exc)) from None
    config.name = name
    return config


def _check_named_files(path: Path, config: ModelConfig) -> None:
    """ConfigError when a file the config names (relative to the model directory
    ``path``) lies outside it."""
    if config.tokenizer:
        contained_file(path, config.tokenizer, "tokenizer")
    for name, adapter in config.generation.lora_modules.items():
        contained_file(path, adapter, f"generation.lora_modules.{name}")


def raw_config(path: Path, filename: str | None = None) -> Any:
    """The keys of the config of the model directory ``path`` as written, not validated
    (``filename``: which of CONFIG_FILES; the first present when None); {} without one.
    ConfigError when the file does not parse."""
    if filename is None:
        filename = next((n for n in CONFIG_FILES if (path / n).is_file()), None)
        if filename is None:
            return {}
    source = f"{path.name}/{filename}"
    text = (path / filename).read_text()
    if filename == TRITON_CONFIG_FILENAME:
        return parse_triton_config(text, source)
    try:
        return yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None


def is_generative(model: ModelDirectory) -> bool:
    """Whether the OpenAI lane (slipstream.llm) serves this model rather than the V2 lane."""
    kind = _KINDS.get(model)
    return kind is not None and kind[0]


def is_cascade(model: ModelDirectory) -> bool:
    """Whether the model is made of other models: a cascade (``cascade:`` in its
    config.yaml) or an ensemble (``ensemble:``, Triton's ``ensemble_scheduling``), which
    the serving core builds from them rather than loading a file. A config that does not
    parse says one when it mentions one, so its error is reported where they are built."""
    kind = _KINDS.get(model)
    if kind is not None:
        return kind[1]
    texts = [_config_text(model.path / filename) for filename in CONFIG_FILES]
    return any(mark in text for text in texts for mark in _COMPOSED_MARKS)


# What a config that does not parse mentions when it is a cascade's or an ensemble's.
_COMPOSED_MARKS = ("cascade:", "ensemble:", "ensemble_scheduling")


def config_stamp(path: Path) -> tuple[int, ...] | None:
    """What changes when the config file of the model directory ``path`` changes (which
    of the names, inode, size, times); None when it has none."""
    for index, filename in enumerate(CONFIG_FILES):
        try:
            info = (path / filename).stat()
        except OSError:
            continue
        return (index, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    return None


class ConfigMemo(Generic[T]):
    """What ``take`` draws from each model's config, kept per config file stamp: the file
    is parsed again only once it changed. A config that fails to parse is not kept.

        kinds = ConfigMemo(lambda config: config.generative)
        kinds.get(directory)        # True / False; None: the config does not parse
    """

    # More directories than that seen: most are long gone; start again.
    MAX_KEPT = 40_000

    def __init__(self, take: Callable[[ModelConfig], T]) -> None:
        self._take = take
        self._kept: dict[Path, tuple[tuple[int, ...] | None, T]] = {}

    def get(self, model: ModelDirectory) -> T | None:
        stamp = config_stamp(model.path)
        known = self._kept.get(model.path)
        if known is not None and known[0] == stamp:
            return known[1]
        try:
            value = self._take(read_config(model))
        except ConfigError:
            return None
        if len(self._kept) >= self.MAX_KEPT:
            self._kept.clear()
        self._kept[model.path] = (stamp, value)
        return value


# (generative, cascade) of each model. Every listing of the repository asks both of
# every model: for 500 models that took 132 ms parsing each config twice with libyaml,
# 7 ms with the stamps.
_KINDS = ConfigMemo(
    lambda config: (config.generative, config.cascade is not None or config.ensemble is not None)
)


def _config_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def named_model_file(version_dir: Path, config: ModelConfig) -> Path | None:
    """The file ``default_model_filename`` names (ConfigError if missing), or None."""
    if not config.default_model_filename:
        return None
    path = contained_file(version_dir, config.default_model_filename, "default_model_filename")
    if not path.exists():
        raise ConfigError(f"default_model_filename: {path} does not exist")
    return path


def model_file(version_dir: Path, config: ModelConfig) -> Path:
    """The model file inside a version directory."""
    named = named_model_file(version_dir, config)
    if named is not None:
        return named
    # A backend's own file names (Triton FIL's xgboost.json, model.txt, ...).
    own = own_model_file(version_dir, config.backend, config.parameters)
    if own is not None:
        return own
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
