"""The registry lock rule (src/ffi/registry.rs, `enter`): no Python object is released while the
lock is held, and no entry waits for the lock while holding the GIL. Broken, two threads
deadlock: one holds the lock and drops the last reference to a retired tensor (its Python
deallocation needs the GIL), the other holds the GIL in a `_direct` entry and waits for the lock.

Each case runs in a child process under a watchdog, so a deadlock fails the test (with the
child's stacks) instead of hanging CI."""

import os
import subprocess
import sys
import textwrap

import pytest

# Managers per thread, tensors made and dropped inside the loop (the manager holds the last
# reference from retire to finalize / acquire / destroy), every entry kind that can drop one.
WORKER = textwrap.dedent(
    """
    import faulthandler, sys, threading, torch
    import sched_lifetime as sl
    from sched_lifetime import ops

    threads, iters, shared = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "shared"
    faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True)  # the watchdog: stacks, then exit 1
    s = sl.current_stream(torch.device("cpu"))
    common = sl.LifetimeManager("shared") if shared else None
    lock = threading.Lock()  # a shared manager's calls are ordered by the user (one plan, many threads)
    errors = []

    def work(k):
        global common
        try:
            for i in range(iters):
                with lock if shared else _nolock():
                    m = common if shared else sl.LifetimeManager(f"t{k}.{i}")
                    for j in range(4):
                        t = torch.empty(256)
                        if j < 2 or i % 3:
                            m.retire(t, s, owner_stream=s)           # direct entry, empty_storage kept to the end
                        elif j == 2:
                            m.release_after(t, s, s, action="drop_reference")  # direct release
                        else:
                            m.bind(t)                                # op path (no stream given)
                            ops.retire(m.handle, [t], s, sl.ACTIONS["drop_reference"])
                            m.acquire(s)
                        del t
                    if shared and i % 20 == 19:
                        m.finalize()                                 # drops the kept tensors
                        m.close()
                        common = sl.LifetimeManager("shared")
                if not shared:
                    m.finalize()
                    m.close()                                        # destroy: drops what it holds
        except Exception as e:
            errors.append(repr(e))

    class _nolock:
        def __enter__(self): return self
        def __exit__(self, *a): return False

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    if shared:
        common.finalize(); common.close()
    assert not errors, errors
    import json
    live = json.loads(ops.live())
    assert live == {"managers": 0, "tensors": 0}, live  # every manager closed, nothing held
    print("done", threads, iters)
    """
)


@pytest.mark.parametrize(
    "threads,iters,managers",
    [(2, 3000, "own"), (4, 1500, "own"), (2, 2000, "shared"), (4, 1000, "shared")],
)
def test_lock_rule_threads_dropping_retired_tensors_never_deadlock(threads, iters, managers):
    watchdog = 45
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(threads), str(iters), managers, str(watchdog)],
        capture_output=True,
        text=True,
        timeout=watchdog + 30,
        env=env,
    )
    assert proc.returncode == 0 and f"done {threads} {iters}" in proc.stdout, (
        f"{threads} threads, {managers} managers: exit {proc.returncode} (a deadlock prints every "
        f"thread's stack after {watchdog} s)\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    )
