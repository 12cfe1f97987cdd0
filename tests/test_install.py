"""What `pip install .` gives: the package `gptkit` and `model`, nothing with a generic name, and every module
of the package importable from anywhere (not only from the checkout)."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

IMPORT_ALL = """
import importlib, json, pkgutil, sys
import gptkit, model
names = [m.name for m in pkgutil.walk_packages(gptkit.__path__, "gptkit.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "gptkit": gptkit.__file__, "model": model.__file__,
                  "train": importlib.util.find_spec("train") is not None}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ behind in the source folder (and would reuse a stale one).
    source = out / "source"
    anywhere = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*_cache")
    at_top = shutil.ignore_patterns("data", "out*", "shared")  # datasets and runs (gptkit/data/ is the package's)
    shutil.copytree(REPO, source, ignore=lambda folder, names: anywhere(folder, names)
                    | (at_top(folder, names) if Path(folder) == REPO else set()))
    # --no-build-isolation: the build backend (setuptools) is already here; no network needed.
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{done.stdout}\n{done.stderr}")
    (path,) = out.glob("gptkit-*.whl")
    return path


def test_wheel_holds_the_package_and_model_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"gptkit", "model.py"}
    assert "gptkit/data/prepare/tiny_shakespeare.py" in names  # subpackages are found, not listed by hand
    assert "gptkit/serving/page.html" in names  # the chat page: package data
    assert {"gptkit/csrc/cpu_decode.cpp", "gptkit/csrc/kernels.h"} <= set(names)  # the CPU kernels' C++


def test_every_module_imports_from_a_plain_install_outside_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=elsewhere, capture_output=True, text=True,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["gptkit"]).is_relative_to(target) and Path(found["model"]).is_relative_to(target)
    assert {"gptkit.config", "gptkit.checkpoint", "gptkit.data.prepare.hub"} <= set(found["modules"])
    in_checkout = {".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                   for f in (REPO / "gptkit").rglob("*.py")} - {"gptkit"}
    assert set(found["modules"]) == in_checkout  # every module of the checkout's package, imported
    assert not found["train"]  # scripts are not installed: no `train` module shadowing another project's
