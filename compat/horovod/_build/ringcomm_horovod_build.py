"""Build backend of the ``horovod`` compat distribution: setuptools', refusing where a real Horovod is installed.

pip builds a wheel before it uninstalls the distribution it replaces, so a refusal here leaves an
installed Horovod untouched.  The check reads the installation folders of the interpreter that runs
the build (``sys.prefix``: the environment pip installs into, with or without build isolation).
Building the sdist is never refused.
"""

from __future__ import annotations

import sysconfig
from importlib import metadata
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import build_sdist, get_requires_for_build_sdist

__all__ = ["build_sdist", "get_requires_for_build_sdist", "get_requires_for_build_wheel",
           "prepare_metadata_for_build_wheel", "build_wheel", "get_requires_for_build_editable",
           "prepare_metadata_for_build_editable", "build_editable", "installed_horovods", "refusal"]

#: The local version label that marks this distribution (``0.28.1+ringcomm.0.1.0``).
LABEL = "+ringcomm"


def installed_horovods(paths: list[str]) -> list[tuple[str, str]]:
    """``(version, folder)`` of each ``horovod`` distribution in ``paths`` that is not this compat one."""
    found = []
    for dist in metadata.distributions(path=paths):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "horovod" and LABEL not in dist.version:
            found.append((dist.version, str(dist.locate_file(""))))
    return found


def refusal(found: list[tuple[str, str]]) -> str:
    version, where = found[0]
    return (f"horovod {version} (Horovod) is installed in {where}; ringcomm's horovod compat distribution "
            f"(horovod 0.28.1{LABEL}...) would replace it. Uninstall it first (`pip uninstall horovod`), or install "
            "the compat distribution into another virtual environment; beside Horovod, use ringcomm as "
            "`import ringcomm_torch as hvd` and `ringcomm-run`")


def _check() -> None:
    paths = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    found = installed_horovods(paths)
    if found:
        raise RuntimeError(refusal(found))


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    _check()
    return _setuptools.get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    _check()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None) -> str:
    _check()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    _check()
    return _setuptools.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: Any = None) -> str:
    _check()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None) -> str:
    _check()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
