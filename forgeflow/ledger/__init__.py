"""The store: the SQL ledger of domain facts and its Alembic ``migrations``.

May import: ``forgeflow.common``. The packages of ``forgeflow`` import one way, in this order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
