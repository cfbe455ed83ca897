"""The import of torch and Lightning, kept out of Python's cyclic garbage collector.

That import makes about 700,000 objects (modules, classes, functions) that live as long as the process.
The collector walks every one of them at each full collection: several times during the import itself,
and again at the interpreter's exit, where it finds nothing to free. On a 2-core EPYC that was about 2 s of a
core in each command (docs/results.md, start-up). Imported with the collector off and then moved to its
permanent generation (`gc.freeze`), they are never walked again; objects made later are collected as
before. The few garbage cycles the import leaves (about 2 % of its objects) stay in memory with them.
"""

import gc
import importlib
import sys
from types import ModuleType


def import_module(name: str) -> ModuleType:
    """`importlib.import_module(name)`, frozen as described above; a module imported already is returned as it is,
    so that a process running many commands (a test session) does not freeze each command's leftovers."""
    if name in sys.modules:
        return sys.modules[name]
    collecting = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        if collecting:
            gc.enable()
        gc.freeze()
