"""cotrain.host.deferred.

Here, in the test process alone; the rest in tests/live/test_deferred.py."""

from __future__ import annotations

import sys
import types

from cotrain.host import deferred


def test_a_module_imported_already_or_missing_is_left_alone(monkeypatch):
    assert deferred.defer("json") is False  # imported by this process
    assert deferred.defer("cotrain_no_such_module.part") is False
    assert deferred.defer("json.no_such_part") is False
    assert "json.no_such_part" not in sys.modules


def test_a_stand_in_imports_the_real_module_at_its_first_attribute(monkeypatch):
    name = "email.quoprimime"
    monkeypatch.delitem(sys.modules, name, raising=False)
    parent = sys.modules.get("email") or __import__("email")
    monkeypatch.delattr(parent, "quoprimime", raising=False)
    assert deferred.defer(name) is True
    stand_in = sys.modules[name]
    assert isinstance(stand_in, deferred.StandIn) and parent.quoprimime is stand_in
    assert stand_in.unquote("=3D") == "="  # the first use imports it
    real = sys.modules[name]
    assert type(real) is types.ModuleType and parent.quoprimime is real
    assert stand_in.header_length is real.header_length  # a kept reference still reaches the real module
