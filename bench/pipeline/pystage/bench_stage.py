#!/usr/bin/python3
"""The benchmark's no-op stage, written with the Python SDK (python/pepsi_stage.py, copied
beside it): every message is advanced to the stage's first NEXT stage, or finished at a final
stage; the twin of ../stage (Go). With BENCH_STAMP=1 it records when the handler first saw
the message as state.t0 (Unix nanoseconds), written by the outcome's own statement."""

import os
import time

import pepsi_stage

NEXT = os.environ.get("PEPSI_NEXT", "").split()
STAMP = os.environ.get("BENCH_STAMP") == "1"


def handle(m: pepsi_stage.Message) -> None:
    if STAMP and "t0" not in m.state:
        m.state["t0"] = time.time_ns()
    if NEXT:
        m.advance(NEXT[0])
    else:
        m.done()


if __name__ == "__main__":
    pepsi_stage.run(handle)
