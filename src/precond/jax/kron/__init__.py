"""PSGD Kron and pro: ``scale_by_kron``/``kron`` with the EQ, QUAD, PRO and QEQ
update styles, distributed-kron 2.0's ``pro`` recipe and ``pro_adamw``, with
their arguments, layouts, states and steps.
"""
