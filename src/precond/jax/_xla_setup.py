"""Imported first by ``precond.jax``: adds XLA:CPU's deadlock workaround to
``XLA_FLAGS`` while JAX's backend has not started (see
:mod:`precond._common.xla_workarounds`). A flag the user set is kept."""

from precond._common.xla_workarounds import avoid_xla_cpu_deadlock

avoid_xla_cpu_deadlock()
