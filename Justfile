# Recipes for working on the launcher. `pip install -e '.[dev]'` brings `just` (rust-just).

# Install torch (CPU build where available) and the project with its dev tools
setup:
    python3 -m pip install torch==2.13.0
    python3 -m pip install -e '.[dev]'

# Run the quickstart job: tiny BERT, 2 CPU workers, embedded Ray
demo:
    launch jobs/quickstart.yaml

# The whole test suite, as CI runs it (network-namespace tests need root): two workers; a file's
# tests share one
test *ARGS:
    python3 -m pytest -q -n 2 --dist loadfile {{ARGS}}

# Pure logic only: no process, Ray, network namespace or GPU (markers in pyproject.toml)
test-fast *ARGS:
    python3 -m pytest -q -m "not (processes or ray or netns or gpu)" tests/unit {{ARGS}}

# Format the code and apply ruff's safe fixes
fmt:
    ruff format .
    ruff check --fix launcher tests benchmarks examples

# Lint, format check and the import layers (pyproject.toml's importlinter contracts)
lint:
    ruff check launcher tests benchmarks examples
    ruff format --check .
    lint-imports

# Type check (mypy, configured in pyproject.toml)
typecheck:
    mypy

# Benchmarks on this machine (GPU ones live in benchmarks/gpu_bench.py)
bench:
    python3 benchmarks/launch_overhead.py
    python3 benchmarks/preflight_fanout.py
    python3 benchmarks/trainer_vs_hf.py --device cpu

# The GPU comparison (docs/performance.md): 3 interleaved rounds, medians and ranges
gpu-bench *ARGS:
    python3 benchmarks/gpu_bench.py --repeat 3 {{ARGS}}

# Regenerate the JSON Schemas editors use for jobs/*.yaml and cluster.yaml, and docs/spec-reference.md
schema:
    launch schema job > launcher/spec/schemas/job.schema.json
    launch schema cluster > launcher/spec/schemas/cluster.schema.json
    python3 docs/spec_reference.py
