"""SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's factors, as
``soap``/``scale_by_soap`` with their arguments, layout of statistics and bases
in stacks of equal blocks, state, step and placement on meshes.
"""
