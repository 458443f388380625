"""Development and demo fixtures of the vllm-kbit checkout (tiny and real test models, ``make demo``, engine helpers,
the benchmark scripts as modules).

Not part of the installed package (pyproject.toml installs ``vllm_kbit`` only; tests/test_wheel_contents.py checks
it): tests, benchmarks, examples and ``make demo`` import it from the checkout's root.
"""
