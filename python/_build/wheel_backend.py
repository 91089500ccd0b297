"""A PEP 517 build backend for the one-module package pepsi-stage, with no dependencies.

It is in the tree so that `pip install ./python` works where pip cannot download a build
backend (no index, or no network): setuptools is not needed to install one .py file. It
builds a pure-Python wheel of pepsi_stage.py and, for `python -m build`, an sdist.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "pepsi_stage"
DIST = "pepsi-stage"


def _version() -> str:
    with open(os.path.join(HERE, NAME + ".py"), encoding="utf-8") as f:
        m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not m:
        raise RuntimeError("pepsi_stage.py has no __version__")
    return m.group(1)


def _metadata() -> str:
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    return (f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {_version()}\n"
            "Summary: Write pepsi-dispatch stages in Python: the worker protocol, batching and outcomes\n"
            "Requires-Python: >=3.9\nRequires-Dist: psycopg>=3.1\n"
            "Description-Content-Type: text/markdown\n\n" + readme)


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = _version()
    info = f"{NAME}-{version}.dist-info"
    with open(os.path.join(HERE, NAME + ".py"), "rb") as f:
        module = f.read()
    files = [
        (NAME + ".py", module),
        (f"{info}/METADATA", _metadata().encode()),
        (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: pepsi-stage wheel_backend\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    ]
    record = "\n".join(_record_line(p, d) for p, d in files) + f"\n{info}/RECORD,,\n"
    name = f"{NAME}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in files:
            z.writestr(p, d)
        z.writestr(f"{info}/RECORD", record)
    return name


def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{_version()}"
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for p in ("pepsi_stage.py", "pyproject.toml", "README.md", "_build/wheel_backend.py"):
            t.add(os.path.join(HERE, p), arcname=f"{base}/{p}")
        pkg = _metadata().encode()
        ti = tarfile.TarInfo(f"{base}/PKG-INFO")
        ti.size = len(pkg)
        t.addfile(ti, io.BytesIO(pkg))
    return name
