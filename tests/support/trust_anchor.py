"""Helpers the test_trust_anchor tests share across suites."""

from __future__ import annotations

import dataclasses

from cotrain.config import RunConfig

RUN = "anchor-test"


def run_fields(**changes) -> dict:
    return dataclasses.asdict(dataclasses.replace(RunConfig(run_id=RUN), **changes))
