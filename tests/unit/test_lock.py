"""requirements/lock.txt matches pyproject.toml, and this environment was installed from it.

A requirement changed in pyproject.toml without `make lock` fails here, as does an
environment that drifted from the lock (a package installed or upgraded by hand).
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins(lock: str = "lock.txt") -> dict[str, tuple[Version, Requirement]]:
    """Every pin of a lock that applies to this interpreter and platform, by name."""
    pins = {}
    for line in (ROOT / "requirements" / lock).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"lock line {line!r} is not a pin"
        pins[canonicalize_name(requirement.name)] = (Version(spec.version), requirement)
    return pins


def _declared(extras: bool = True) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    if extras:
        for extra in project["optional-dependencies"].values():
            lines.extend(extra)
    # `all` names the project's own extras: what they hold is checked through them.
    return [r for r in map(Requirement, lines) if canonicalize_name(r.name) != "slipstream"]


def test_the_all_extra_installs_every_other_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (everything,) = (Requirement(line) for line in extras["all"])
    assert canonicalize_name(everything.name) == "slipstream"
    assert everything.extras == set(extras) - {"all", "dev"}


def test_every_declared_requirement_is_pinned_within_its_range() -> None:
    pins = _pins()
    for requirement in _declared():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in the lock: run `make lock`"
        version, _ = pins[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"the lock pins {name}=={version} outside pyproject's {requirement}: run `make lock`"
        )


def test_the_environment_is_the_lock() -> None:
    drifted = []
    for name, (version, _) in _pins().items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            drifted.append(f"{name}=={version} is not installed")
            continue
        if installed != version:
            drifted.append(f"{name}: {installed} installed, {version} locked")
    assert not drifted, "; ".join(drifted) + " (reinstall with `make install`)"


def test_the_lowest_lock_holds_each_core_dependency_at_its_lower_bound() -> None:
    # requirements/lowest.txt is what `make test-lowest` installs; a bound raised or
    # lowered in pyproject.toml without `make lock` would test some other release.
    pins = _pins("lowest.txt")
    for requirement in _declared(extras=False):
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (bound,) = [s for s in requirement.specifier if s.operator == ">="]
        version, _ = pins[canonicalize_name(requirement.name)]
        assert version == Version(bound.version), (
            f"lowest.txt has {requirement.name}=={version}, pyproject's bound is {bound}: "
            "run `make lock`"
        )
