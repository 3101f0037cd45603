"""precond bench: train real workloads with precond's optimizers and AdamW side by side.

Registries of workloads (``workloads``) and optimizers (``optimizers``), a runner that
times compiled steps and measures optimizer state (``runner``), and the CLI (``cli``).
"""
