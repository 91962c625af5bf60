"""GPU A/B: record_stream vs scheduled release on a lagging two-stream pipeline, side by side in
one process (max reserved, max allocated, pending-free peak, distinct blocks, step time, CUDA
graph pool). Same code as `python -m sched_lifetime ab`; kept here with the other benchmarks."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))

from sched_lifetime.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["ab", *sys.argv[1:]]))
