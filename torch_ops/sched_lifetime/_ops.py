"""Loads the compiled library and registers what torch needs around its ops (fakes, side
effects). The ops themselves are registered from C++ (cpp/shim.cc) as torch.ops.sched_lifetime.*."""

from __future__ import annotations

import glob
import json
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _library_path() -> str:
    explicit = os.environ.get("SCHED_LIFETIME_LIB")
    if explicit:
        return explicit
    # Built by setuptools-rust as _C.cpython-3XX-...so, or copied as _C.so by `make build`;
    # the library has no Python ABI, so any of them loads in any Python. Newest wins.
    found = sorted(glob.glob(os.path.join(_HERE, "_C*.so")), key=os.path.getmtime, reverse=True)
    if not found:
        raise ImportError(
            f"sched_lifetime: no compiled library (_C*.so) in {_HERE}; build it with "
            "`make build` or `pip install --no-build-isolation .`, or set SCHED_LIFETIME_LIB"
        )
    return found[0]


LIBRARY = _library_path()
torch.ops.load_library(LIBRARY)
ops = torch.ops.sched_lifetime


def _load_direct(path: str):
    """The same library as the Python module `sched_lifetime._direct` (cpp/direct.cc): bind /
    retire / acquire for the eager hot path without the torch.ops round trip, calling the same
    Rust entry points as the ops."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("sched_lifetime._direct", path)
    spec = importlib.util.spec_from_file_location("sched_lifetime._direct", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


direct = _load_direct(LIBRARY)

#: What Rust defines and Python must not copy: action names and codes, the launch-budget
#: range and variables, stream roles, stats fields, simulator policies and modes.
INFO: dict = json.loads(ops.info())

#: Names of the counters `stats` returns, in order (defined in Rust).
STATS_FIELDS: tuple[str, ...] = tuple(INFO["stats_fields"])


def _no_output(*args: object) -> None:
    return None


for _name in ("bind", "retire", "retire_owned", "passthrough"):
    torch.library.register_fake(f"sched_lifetime::{_name}")(_no_output)

# None of the ops returns what it does: keep FX from dead-code-eliminating them.
for _name in ("create", "bind", "retire", "retire_owned", "passthrough", "acquire", "finalize", "destroy"):
    torch.fx.node.has_side_effect(getattr(ops, _name).default)

# torch 2.11's FX schema-to-signature table (used by opcheck's schema test and by FX
# normalization) has no entry for the `Stream` schema type, so any op taking a Stream fails
# there with "name 'Stream' is not defined". Teach it the type the dispatcher already uses.
try:
    from torch.fx import operator_schemas as _fx_schemas

    _fx_schemas._type_eval_globals.setdefault("Stream", torch.Stream)
except (ImportError, AttributeError):  # a torch without the table needs no fix
    pass


def json_text(value: object, what: str) -> str:
    """A dict as JSON text for the ops that take JSON; text passes through."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value)
    raise ValueError(f"{what} must be a dict or JSON text, got {type(value).__name__}")
