"""Model names: the one validator every entry point uses, and the paths built from names."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slipstream.config import ConfigError, ModelConfig, ServerSettings, parse_model_config
from slipstream.errors import InvalidRequest
from slipstream.names import (
    MAX_MODEL_NAME_LENGTH,
    MODEL_NAME_RULE,
    model_name_problem,
    path_model_name,
    validate_model_name,
)
from slipstream.repository.layout import (
    contained_file,
    list_models,
    model_path,
    named_model_file,
    read_config,
    read_model_directory,
)

VALID_NAMES = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}", fullmatch=True)
SEPARATORS = st.sampled_from(["/", "\\"])
CONTROL_CHARS = st.characters(max_codepoint=0x1F) | st.just("\x7f")
NON_ASCII = st.characters(min_codepoint=0x80)


def refused(name: str) -> str:
    """The message validate_model_name refuses ``name`` with (fails if it accepts it)."""
    with pytest.raises(InvalidRequest) as error:
        validate_model_name(name)
    assert error.value.http_status == 400 and error.value.grpc_code == "INVALID_ARGUMENT"
    assert MODEL_NAME_RULE in error.value.message
    return error.value.message


# -- the validator -----------------------------------------------------------------------


@given(VALID_NAMES)
def test_valid_names_are_accepted_unchanged_and_round_trip(name: str) -> None:
    assert validate_model_name(name) == name
    # Through a URL path segment and back, and onto the repository as one directory.
    assert path_model_name(quote(name, safe="")) == name
    path = Path("/repo") / name
    assert path.name == name and path.parent == Path("/repo")


@given(st.text(max_size=200))
def test_an_accepted_name_never_leaves_the_repository(name: str) -> None:
    if model_name_problem(name) is None:
        joined = os.path.normpath(os.path.join("/repo", name))
        assert os.path.dirname(joined) == "/repo" and os.path.basename(joined) == name


@given(st.text(max_size=60), SEPARATORS | CONTROL_CHARS | NON_ASCII, st.text(max_size=60))
def test_a_separator_control_or_non_ascii_character_is_refused(
    before: str, bad: str, after: str
) -> None:
    refused(before + bad + after)


@given(st.text(alphabet="./\\", min_size=1, max_size=20))
def test_dots_and_separators_alone_are_refused(name: str) -> None:
    refused(name)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "is empty"),
        (".", "relative directory reference"),
        ("..", "relative directory reference"),
        (".hidden", "starts with '.'"),
        ("-rf", "starts with '-'"),
        ("../evilrepo/evil", "contains '/', a path separator"),
        ("/tmp/evilrepo/evil", "contains '/', a path separator"),
        ("a\\..\\b", "contains '\\\\', a path separator"),
        ("a\x00b", "control character U+0000"),
        ("a\nb", "control character U+000A"),
        ("..\uff0fetc", "U+FF0F"),  # fullwidth solidus
        ("digits\u0430", "U+0430"),  # Cyrillic a
        ("a%2Fb", "contains '%'"),
        ("a b", "contains ' '"),
        ("x" * (MAX_MODEL_NAME_LENGTH + 1), f"more than {MAX_MODEL_NAME_LENGTH}"),
    ],
)
def test_each_rule_is_named_in_the_message(name: str, problem: str) -> None:
    assert problem in refused(name)


def test_names_at_the_limits_are_accepted() -> None:
    for name in ("a", "_", "7", "resnet50.v2-int8_x", "x" * MAX_MODEL_NAME_LENGTH):
        assert validate_model_name(name) == name


def test_a_long_refused_name_is_shortened_in_the_message() -> None:
    assert len(refused("/" * 100_000)) < 400


def test_path_segments_are_decoded_once_before_the_check() -> None:
    assert "contains '/'" in refused_segment("..%2Fevil")
    assert "contains '%'" in refused_segment("..%252Fevil")  # double encoding stays encoded
    assert "U+0000" in refused_segment("a%00b")
    assert "U+FF0F" in refused_segment("%EF%BC%8Fetc")
    assert "not ASCII" in refused_segment("%FF")  # not UTF-8


def refused_segment(segment: str) -> str:
    with pytest.raises(InvalidRequest) as error:
        path_model_name(segment)
    return error.value.message


# -- names in settings and config files ----------------------------------------------------


def test_load_model_option_is_checked() -> None:
    with pytest.raises(ValueError, match="contains '/', a path separator"):
        ServerSettings(model_repository=Path("/repo"), load_models=["ok", "../evil"])
    assert ServerSettings(model_repository=Path("/repo"), load_models=["ok"]).load_models == ["ok"]


def test_config_name_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"m/config.yaml: name: .*path separator"):
        parse_model_config({"name": "../m"}, "m/config.yaml")
    assert parse_model_config({"name": "m"}, "m/config.yaml").name == "m"


# -- paths built from names ----------------------------------------------------------------


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """repo/ with model ``good``, ``alias`` (a symlink to it) and ``escape`` (a symlink
    to a model directory outside the repository)."""
    repo = tmp_path / "repo"
    (repo / "good" / "1").mkdir(parents=True)
    (repo / "alias").symlink_to(repo / "good")
    outside = tmp_path / "evilrepo" / "evil"
    (outside / "1").mkdir(parents=True)
    (repo / "escape").symlink_to(outside)
    (repo / "bad name").mkdir()
    return repo


def test_model_path_stays_inside_the_repository(repository: Path) -> None:
    assert model_path(repository, "good") == repository / "good"
    assert model_path(repository, "alias") == repository / "alias"
    assert model_path(repository, "absent") == repository / "absent"
    with pytest.raises(InvalidRequest, match="outside the model repository"):
        model_path(repository, "escape")
    with pytest.raises(InvalidRequest, match="path separator"):
        model_path(repository, "../evilrepo/evil")


def test_a_symlink_loop_is_refused_not_crashed_on(repository: Path) -> None:
    (repository / "loop").symlink_to(repository / "loop")
    # Python < 3.13 reports the loop while resolving; 3.13 resolves it to itself, which
    # is no directory, so nothing loads from it either way.
    try:
        path = model_path(repository, "loop")
    except InvalidRequest as error:
        assert "fix the symlink" in error.message
    else:
        assert path == repository / "loop" and not path.is_dir()


def test_listing_skips_escaping_symlinks_and_bad_names(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert sorted(list_models(repository)) == ["alias", "good"]
    assert "outside the model repository" in caplog.text and "bad name" in caplog.text


def test_files_a_config_names_stay_in_the_model_directory(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}")
    (model / "outside.json").symlink_to(tmp_path)
    assert contained_file(model, "tokenizer.json", "tokenizer") == model / "tokenizer.json"
    for relative in ("../../etc/passwd", "/etc/passwd", "outside.json", "1/../../x"):
        with pytest.raises(ConfigError, match=r"tokenizer: .*outside the model's directory"):
            contained_file(model, relative, "tokenizer")
    with pytest.raises(ConfigError, match="NUL"):
        contained_file(model, "a\x00b", "tokenizer")


def test_a_config_naming_files_outside_fails_to_load(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.yaml").write_text("tokenizer: ../../etc/passwd\n")
    with pytest.raises(ConfigError, match=r"tokenizer: '\.\./\.\./etc/passwd' resolves to"):
        read_config(read_model_directory(model))
    config = ModelConfig(default_model_filename="../../../etc/passwd")
    with pytest.raises(ConfigError, match=r"default_model_filename: .*outside"):
        named_model_file(model / "1", config)
