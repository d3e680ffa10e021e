"""From candidates to a frozen dataset: bug generation, candidate rows, batch selection, freezes, bundles,
derived sets and recovery.

May import: ``common``, ``ledger``, ``registry``, ``sandbox``.
"""
