# Developer shortcuts. The README's two commands (scripts/setup.sh demo|test) need nothing but
# Rust, gcc, Python 3.11 and pip; these targets assume the environment already exists.
PYTHON ?= python3
export PYTHON

.PHONY: build test test-rust test-python bench clean

# Build the torch-linked library into the package (incremental; what the GPU runs carry).
build:
	cargo build --release --features torch
	cp target/release/libsched_lifetime.so torch_ops/sched_lifetime/_C.so

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
	rm -f torch_ops/sched_lifetime/_C*.so
