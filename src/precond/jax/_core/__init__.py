"""The shared engine of precond's JAX optimizers: kernels of Kronecker factors,
pool-safe linear algebra, blocks, placement on meshes, the step policy, random
draws, guards, precision, argument trees and the alias layer.
"""
