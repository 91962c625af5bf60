"""SIMULATED (GPU-like des.py, true link times): the step under ours, ours:launch_first and the
search as the library now runs it (Rust model with launch waits, true costs), per structure."""
import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import sys
sys.path.insert(0, HERE)
import sched_lifetime as sl
from variants import run_step, show, G, D
from sched_lifetime.calibrate import with_costs

def searched(k):
    g = dict(G[k]["graph"])
    g = with_costs(g, D(g))
    return (sl.schedule(g, rules="search")["order"],)

keys = ("F", "FB", "B", "FF", "BB")
ours = {k: ("ours",) for k in keys}
lf = {k: ("ours:launch_first",) for k in keys}
srch = {k: searched(k) for k in keys}
show("ours", run_step(ours))
show("ours:launch_first", run_step(lf))
show("search (Rust model with launch waits)", run_step(srch))
show("ours+ends", run_step(ours, ends=True))
show("ours+ends:launch_first", run_step(lf, ends=True))
show("search+ends", run_step(srch, ends=True))
