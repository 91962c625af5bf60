# Developer shortcuts. The README's two commands (scripts/setup.sh demo|test) need nothing but
# Rust, gcc, Python 3.11 and pip; these targets assume the environment already exists.
PYTHON ?= python3
export PYTHON

.PHONY: build gpu-lib test test-rust test-python bench clean

# Build the torch-linked library into the package (incremental; what the GPU runs carry).
build:
	cargo build --release --features torch
	cp target/release/libsched_lifetime.so torch_ops/sched_lifetime/_C.so

# The library to carry to the GPU machine, which runs torch 2.11.0+cu130 (the .venv's 2.15 library
# does not load there): built against requirements-torch2.11.txt's torch in .venv-2.11 (made on
# first use), in its own target dir, into build/torch2.11/_C.so. Carry that file;
# benches/gpu_pass.sh loads it (SCHED_LIFETIME_LIB) when it is there.
gpu-lib:
	test -x .venv-2.11/bin/python || python3 -m venv .venv-2.11
	.venv-2.11/bin/python -m pip install -q --disable-pip-version-check -r requirements-torch2.11.txt
	PYTHON=$(CURDIR)/.venv-2.11/bin/python CARGO_TARGET_DIR=$(CURDIR)/target-2.11 cargo build --release --features torch
	mkdir -p build/torch2.11
	cp target-2.11/release/libsched_lifetime.so build/torch2.11/_C.so

test-rust:
	cargo test

test-python: build
	PYTHONPATH=torch_ops $(PYTHON) -m pytest -q tests/python

test: test-rust test-python

bench:
	cargo bench --bench bench_main
	PYTHONPATH=torch_ops $(PYTHON) benches/python_overhead.py

clean:
	cargo clean
	rm -f torch_ops/sched_lifetime/_C*.so build/torch2.11/_C.so
	rm -rf target-2.11
