"""galore2 benchmarks (not part of the installed package).

Run from the repository root with the project's venv active:

    python -m benchmarks.run_core            # all three, writes BENCHMARKS.md
    python -m benchmarks.run_core --quick    # small sizes, writes runs/BENCHMARKS-quick.md
    python -m benchmarks.refresh [--quick]   # one benchmark, prints its table
    python -m benchmarks.step_time [--quick]
    python -m benchmarks.memory_7b [--quick]
"""
