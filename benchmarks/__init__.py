"""galore2 benchmarks (not part of the installed package).

One runner, every benchmark a task of it (repository root, the project's venv active)::

    python -m benchmarks.run                        # the side-by-side suite → BENCHMARKS.md
    python -m benchmarks.run --list                 # every task and the module that holds it
    python -m benchmarks.run --tasks refresh,step_time [--quick] [--out PATH]
    python -m benchmarks.run --tasks all            # everything (kernels only with CUDA)

See ``benchmarks/run.py`` for every option.
"""
