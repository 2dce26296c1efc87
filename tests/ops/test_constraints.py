"""constraints.txt pins every dependency the project declares, within what it declares, and the
environment the README's set-up makes is the one it pins (CI installs with it)."""
from __future__ import annotations

import os
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pins() -> dict[str, Version]:
    found = {}
    with open(os.path.join(REPO, "constraints.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, sep, version = line.partition("==")
                assert sep, f"constraints.txt: {line!r} is not an exact pin (NAME==VERSION)"
                found[canonicalize_name(name)] = Version(version)
    return found


def declared() -> list[Requirement]:
    requirements = []
    for path in ("pyproject.toml", "client/pyproject.toml"):
        with open(os.path.join(REPO, path), "rb") as f:
            project = tomllib.load(f)["project"]
        requirements += [Requirement(r) for r in project["dependencies"]]
        requirements += [Requirement(r) for r in project.get("optional-dependencies", {}).get("test", [])]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


def test_every_declared_dependency_has_a_pin_within_its_range():
    pinned = pins()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} is a dependency but constraints.txt does not pin it"
        assert requirement.specifier.contains(pinned[name], prereleases=True), \
            f"constraints.txt pins {requirement.name}=={pinned[name]}, outside the declared {requirement.specifier}"


def test_the_installed_dependencies_are_the_pinned_ones():
    pinned = pins()
    for requirement in declared():
        installed = Version(metadata.version(requirement.name))
        assert Version(installed.public) == pinned[canonicalize_name(requirement.name)], \
            f"{requirement.name} {installed} is installed, constraints.txt pins {pinned[canonicalize_name(requirement.name)]}"
