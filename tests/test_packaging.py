"""pyproject.toml: the library builds as a wheel that holds capt/ and its assets (nothing else), and the
installed copy imports and runs from outside the checkout."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import capt

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_the_library_and_runs_installed(tmp_path):
    src = tmp_path / "src"   # a copy: setuptools writes build/ and *.egg-info beside the sources it builds
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if Path(d) == ROOT and n not in
                                                         ("pyproject.toml", "README.md", "capt")] + ["__pycache__"])
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    wheel, = (tmp_path / "dist").glob("capt_playground-*.whl")
    assert wheel.name.startswith(f"capt_playground-{capt.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"capt", f"capt_playground-{capt.__version__}.dist-info"}   # no app, train, tests, capsules
    assert {p.relative_to(ROOT).as_posix() for p in (ROOT / "capt").rglob("*") if p.is_file()
            and "__pycache__" not in p.parts} <= set(names)                    # every module and asset
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    code = ("import capt; b = capt.load_backbone('tiny-llama'); "   # the tiny tokenizer is a package asset
            "p = capt.predict(b, 'rte', {'premise': 'A cat sat.', 'hypothesis': 'A cat sat.'}, "
            "capsule=capt.Capsule.for_backbone(b, seed=0)); print(capt.__file__); print(p.label)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    where, label = run.stdout.strip().splitlines()[-2:]
    assert Path(where).is_relative_to(site) and label in capt.get_task("rte").labels
