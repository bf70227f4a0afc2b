"""environment.yml (conda) and pyproject.toml (pip) must list the same requirements."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = set(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements.update(extra)
    return requirements


def conda_pip_requirements() -> set[str]:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    pip_lists = [item["pip"] for item in environment["dependencies"] if isinstance(item, dict)]
    assert len(pip_lists) == 1, "environment.yml should have exactly one pip: section"
    return {requirement for requirement in pip_lists[0] if not requirement.startswith("-e")}


def test_environment_yml_and_pyproject_list_the_same_requirements():
    in_pyproject, in_conda = pyproject_requirements(), conda_pip_requirements()
    assert in_pyproject == in_conda, (
        f"only in pyproject.toml: {sorted(in_pyproject - in_conda)}; "
        f"only in environment.yml: {sorted(in_conda - in_pyproject)}"
    )


def test_environment_yml_installs_this_package():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    pip_list = next(item["pip"] for item in environment["dependencies"] if isinstance(item, dict))
    assert "-e ." in pip_list
