"""Distributed Shampoo: ``distributed_shampoo``/``scale_by_shampoo`` with their
configuration, block layout, statistics state, matrix roots, placement on
meshes and the conversion of optax-shampoo's state.
"""
