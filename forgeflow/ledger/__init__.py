"""The store: the SQL ledger of domain facts (``tables``: the schema; ``records``: the typed rows;
``store``: the Store API; ``queries``: its reads; ``batched``: its batched upserts; ``dialects``: the upsert
statement and the SQLite file checks; ``migrating``: migrations once per process, safe across threads and
processes; ``group_commit``: trials that end together written in one transaction; ``trial_result``: the typed
trial record, ``TrialResult`` and its parts) and its Alembic ``migrations``.

May import: ``forgeflow.common``. The packages of ``forgeflow`` import one way, in this order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
