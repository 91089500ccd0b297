"""The package installs with `pip install ./python` (no index needed: the build backend is
in the tree), and its metadata matches the module."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile

from conftest import PYDIR


def test_pip_install() -> None:
    d = tempfile.mkdtemp(prefix="pepsi-pytest-venv-")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", d], check=True)
        subprocess.run([f"{d}/bin/pip", "install", "--no-index", "--quiet", str(PYDIR)], check=True,
                       cwd=d)
        out = subprocess.run([f"{d}/bin/python", "-c",
                              "import pepsi_stage, sys; print(pepsi_stage.__file__, pepsi_stage.__version__)"],
                             check=True, stdout=subprocess.PIPE, text=True, cwd=d).stdout.split()
        assert out[0].startswith(d) and out[0].endswith("site-packages/pepsi_stage.py")
        import pepsi_stage
        assert out[1] == pepsi_stage.__version__
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_versions_agree() -> None:
    import pepsi_stage
    text = (PYDIR / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == pepsi_stage.__version__
