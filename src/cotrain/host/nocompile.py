"""Keep ``torch._dynamo`` (torch.compile's tracer) out of a process that never compiles.

torch wraps some of its own functions (an optimizer's ``step``, ``zero_grad``, ``state_dict``, a learning-rate
schedule's) so that torch.compile does not trace into them; the wrapper imports ``torch._dynamo`` at its first
call, about 70 MB of memory in a process (and with it ``torch.export`` and FSDP). The monitor's worker steps
no model and compiles nothing, yet its state keeper's optimizer would import it. ``keep_dynamo_out()`` marks
each such wrapper that exists as already resolved to the function itself (the cache the wrapper looks up
first), so calling it imports nothing. Under torch.compile those functions would then be traced: only a
process that compiles nothing may call this (cotrain's monitor; not the Python API, whose users may compile).

This keeps it out of the monitor of a run with LAMB (the ALBERT and BERT presets). torch's own optimizers
(AdamW, which the other presets use, and DiLoCo's outer SGD) import ``torch._dynamo`` in their ``step``
itself, which hivemind's state averager calls once to create the optimizer's statistics: their monitor imports
it still.

It relies on torch's private ``torch._compile._disable_dynamo``: where that is missing or works otherwise, it
marks nothing and the process imports ``torch._dynamo`` at the first such call, as before.
"""

from __future__ import annotations

import gc
import logging
import sys
import types
from collections.abc import Iterator

logger = logging.getLogger(__name__)

CACHE = "__dynamo_disable"  # the attribute torch's wrapper reads on the wrapped function before importing


def keep_dynamo_out() -> int:
    """Mark the existing wrappers (call after importing what the process uses); returns how many."""
    if "torch._dynamo" in sys.modules:
        return 0
    try:
        from torch._compile import _disable_dynamo

        wrapper_code = _disable_dynamo(lambda: None).__code__
    except (ImportError, AttributeError, TypeError) as e:
        logger.debug(f"torch._dynamo cannot be kept out: {e!r}")
        return 0
    if CACHE not in wrapper_code.co_names and CACHE not in wrapper_code.co_consts:
        logger.debug("torch._dynamo cannot be kept out: torch's wrapper reads no cache this knows")
        return 0
    marked = 0
    for function in _functions():
        if function.__code__ is wrapper_code:
            wrapped = getattr(function, "__wrapped__", None)
            if wrapped is not None and getattr(wrapped, CACHE, None) is None:
                setattr(wrapped, CACHE, wrapped)
                marked += 1
    logger.debug(f"Marked {marked} of torch's compile-disabling wrappers: torch._dynamo stays out")
    return marked


def _functions() -> Iterator[types.FunctionType]:
    """The functions the garbage collector tracks, and those of every imported module and of its classes
    (where torch's wrappers live): the collector does not list objects frozen before a fork
    (cotrain._worker)."""
    for value in gc.get_objects():
        if type(value) is types.FunctionType:
            yield value
    for module in list(sys.modules.values()):
        namespace = module.__dict__ if type(module) is types.ModuleType else {}
        for value in list(namespace.values()):
            # type(), not isinstance() or getattr(): some of torch's module attributes warn or fail when asked
            is_class = type(value) is type
            members = list(type.__dict__["__dict__"].__get__(value).values()) if is_class else [value]
            for member in members:
                if type(member) in (staticmethod, classmethod):
                    member = member.__func__
                if type(member) is types.FunctionType:
                    yield member
