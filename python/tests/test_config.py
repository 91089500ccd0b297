"""load_config reads the command line and the environment as the Go SDK's LoadConfig does.

These are the inputs on which the two once disagreed; stage/config_python_test.go compares the
two readers on many more (and fuzzes them), through this module.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

import pepsi_stage

ENV = {"PEPSI_STAGE": "parse", "PEPSI_NEXT": "enrich deliver", "PEPSI_DSN": "host=/x"}


def load(args: List[str], **env: str) -> pepsi_stage.Config:
    e: Dict[str, str] = dict(ENV)
    e.update(env)
    return pepsi_stage.load_config(args, e)


@pytest.mark.parametrize("args", [["-c", "/f", "worker"], ["-c=/f", "worker"], ["--c", "/f", "worker"],
                                  ["--c=/f", "worker"], ["-c", "/g", "-c", "/f", "worker"],
                                  ["-c", "/f", "--", "worker"]])
def test_config_file_forms(args: List[str]) -> None:
    assert load(args).config_file == "/f"


@pytest.mark.parametrize("args,want", [
    (["-c/f", "worker"], "unknown option '-c/f'"),  # Go's flag package takes it for an option "c/f"
    (["-c"], "needs a FILE"),
    (["-=c", "worker"], "bad option syntax"),
    (["worker", "-c", "/f"], "usage"),
])
def test_bad_arguments(args: List[str], want: str) -> None:
    with pytest.raises(ValueError, match=want):
        load(args)


@pytest.mark.parametrize("var,text,want", [
    ("PEPSI_STAGE", "parse\n", "stage name"),
    ("PEPSI_NEXT", "enrich\x1cdeliver", "next stage name"),
    ("PEPSI_FUSE", "enrich=deliver,,archive", "next stage name ''"),
    ("PEPSI_FUSE", "enrich=deliver,", "next stage name ''"),
    ("PEPSI_MAX_CHILDREN", "\u0663", "want a positive whole number"),
    ("PEPSI_MAX_CHILDREN", "\u00b2", "want a positive whole number"),
    ("PEPSI_MIN_SPAN", "2147483648", "want a positive whole number"),
    # int() refuses past 4,300 digits with its own message, which named no variable.
    pytest.param("PEPSI_MAX_CHILDREN", "1" * 5000, "PEPSI_MAX_CHILDREN = .*want a positive whole number",
                 id="PEPSI_MAX_CHILDREN-5000-digits"),
])
def test_refused_as_in_go(var: str, text: str, want: str) -> None:
    with pytest.raises(ValueError, match=want):
        load(["worker"], **{var: text})


def test_leading_zeros_as_in_go() -> None:
    """Go's strconv.ParseInt takes any number of leading zeros; int() refused past 4,300 digits."""
    assert load(["worker"], PEPSI_MIN_SPAN="0" * 5000 + "7").min_span == 7


def test_read_as_in_go() -> None:
    cfg = load(["worker"], PEPSI_NEXT="enrich\u00a0deliver\u3000", PEPSI_MAX_CHILDREN="+5",
               PEPSI_FUSE="enrich=deliver\u2028deliver=")
    assert cfg.next == ["enrich", "deliver"]
    assert cfg.max_children == 5
    assert cfg.fuse == {"enrich": ["deliver"], "deliver": []}
