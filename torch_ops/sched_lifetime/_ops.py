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

ops.__doc__ = """The library's ops, `torch.ops.sched_lifetime.*`, registered from C++ with Rust behind them.

Typed lifetime ops (tensor lists and `Stream`s, so they trace under torch.compile and record
into CUDA graphs): `create(str) -> int`, `bind(int, Tensor[], Stream)`,
`retire(int, Tensor(a!)[], Stream, int action)`, `retire_owned(...)`,
`passthrough(int, Tensor[])`, `acquire(int, Stream) -> int`, `finalize(int) -> int[]`,
`stats(int) -> int[]`, `destroy(int)`. JSON ops (JSON text in and out): `info`, `schedule`,
`schedule_order`, `validate`, `lower`, `simulate`, `simulate_schedule`, `scenario`,
`page_plan`. `sl.LifetimeManager` and the functions of `sched_lifetime` wrap them; call the ops
directly from FX graphs or C++-free custom code.

Example:

    >>> import torch, sched_lifetime as sl
    >>> cpu = sl.current_stream(torch.device("cpu"))
    >>> h = sl.ops.create("mb0")                   # a manager handle
    >>> x = torch.ones(4)
    >>> sl.ops.bind(h, [x], cpu)
    >>> sl.ops.retire(h, [x], cpu, sl.ACTIONS["empty_storage"])   # same stream: released at once
    >>> stats = dict(zip(sl.STATS_FIELDS, sl.ops.finalize(h)))
    >>> stats["immediate"], x.untyped_storage().nbytes()
    (1, 0)
    >>> sl.ops.destroy(h)
"""


class Info(dict):
    """What Rust defines and Python must not copy (`torch.ops.sched_lifetime.info()`, parsed):
    `actions` (name -> code) and `default_action`, `budget` (launch-budget range, defaults
    and environment variables), `roles` (stream roles), `stats_fields`, `policies` and `modes`
    (simulator), `scheduler_rules`, `storage_emptying_actions`.

    Example:

        >>> import sched_lifetime as sl
        >>> sl.INFO["budget"]["ep_var"], sl.INFO["budget"]["default_ep"]
        ('SCHED_LIFETIME_EP_LAUNCH_BUDGET', 1)
        >>> sl.INFO["roles"]
        ['compute', 'ep', 'page']
    """


class StatsFields(tuple):
    """Names of the counters a lifetime manager's `stats()` / `finalize()` return, in the order
    the ops return them (defined in Rust).

    Example:

        >>> import sched_lifetime as sl
        >>> sl.STATS_FIELDS[:3]
        ('bound', 'bound_now', 'retired_empty_storage')
        >>> "fallback_record_stream" in sl.STATS_FIELDS
        True
    """


#: What Rust defines and Python must not copy: action names and codes, the launch-budget
#: range and variables, stream roles, stats fields, simulator policies and modes.
INFO: Info = Info(json.loads(ops.info()))

#: Names of the counters `stats` returns, in order (defined in Rust).
STATS_FIELDS: StatsFields = StatsFields(INFO["stats_fields"])


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
