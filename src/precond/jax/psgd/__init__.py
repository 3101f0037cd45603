"""psgd-jax's PSGD family: XMat, LRA and Affine preconditioners on one shared
transform (``scale_by_psgd``), their placement on meshes, and
``hessian_helper`` for Newton-mode fitting.
"""
