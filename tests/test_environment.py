"""environment.yml (conda) and pyproject.toml (pip) must list the same requirements."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"
    ]
    requirements = set(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements.update(extra)
    return requirements


def conda_pip_requirements() -> set[str]:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    pip_lists = [
        item["pip"] for item in environment["dependencies"] if isinstance(item, dict)
    ]
    assert len(pip_lists) == 1, "environment.yml should have exactly one pip: section"
    return {
        requirement for requirement in pip_lists[0] if not requirement.startswith("-e")
    }


def test_environment_yml_and_pyproject_list_the_same_requirements():
    in_pyproject, in_conda = pyproject_requirements(), conda_pip_requirements()
    assert in_pyproject == in_conda, (
        f"only in pyproject.toml: {sorted(in_pyproject - in_conda)}; "
        f"only in environment.yml: {sorted(in_conda - in_pyproject)}"
    )


def test_environment_yml_installs_this_package():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    pip_list = next(
        item["pip"] for item in environment["dependencies"] if isinstance(item, dict)
    )
    assert "-e ." in pip_list


def test_python_minimum_in_pyproject_matches_the_readme_and_this_interpreter():
    # tomllib (3.11+) is imported above, so the stated minimum must be at least 3.11.
    import re
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"
    ]
    match = re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"])
    assert match, (
        f"requires-python {project['requires-python']!r} is not of the form >=X.Y"
    )
    minimum = (int(match[1]), int(match[2]))
    assert minimum >= (3, 11), (
        f"the tests need tomllib (Python 3.11+), but pyproject allows {minimum}"
    )
    assert sys.version_info[:2] >= minimum
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"{minimum[0]}.{minimum[1]} or newer" in readme, (
        "README.md states a different Python minimum"
    )
