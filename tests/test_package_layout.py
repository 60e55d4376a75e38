"""The package's folders: every sub-package is installed, and the public names that moved with the
folders (specbatch.testing, specbatch.conform, the console script, the pytest plugin) still reach
the same code."""
import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_folder_with_an_init_is_an_installed_package():
    """A folder missing from pyproject's packages would be dropped by a non-editable install."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = config["package-dir"]
    declared = set(config["packages"])
    found = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert found == declared
    for name in declared:
        importlib.import_module(name)


@pytest.mark.parametrize("public, home", [("specbatch.testing", "specbatch.conformance.testing"),
                                          ("specbatch.conform", "specbatch.conformance.greedy")])
def test_public_names_are_the_moved_modules_themselves(public, home):
    """Same module object, so a monkeypatch or an isinstance check through either name holds for both."""
    assert importlib.import_module(public) is importlib.import_module(home)
    parent, _, leaf = public.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is importlib.import_module(home)


@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_entry_points_reach_the_cli_and_the_plugin():
    points = importlib.metadata.entry_points()
    script = [p for p in points.select(group="console_scripts") if p.name == "specbatch"]
    plugin = [p for p in points.select(group="pytest11") if p.name == "specbatch"]
    assert len(script) == 1 and len(plugin) == 1
    from specbatch.cli.commands import main
    from specbatch.conformance import testing
    assert script[0].load() is main
    assert plugin[0].load() is testing
    done = subprocess.run([sys.executable, "-m", "specbatch", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "conform" in done.stdout
