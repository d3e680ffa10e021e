"""From candidates to a frozen dataset: bug generation (``bugs``), candidate rows (``candidates``,
``generated``, ``task_rows``), batch selection (``selection``), a curate run's settings
(``curate_settings``) and what the curate and recover flows return (``curate_result``), freezes
(``freeze``) and their export bundles (``bundle``), derived sets (``derived``)
and recovery by exact ids (``recovery``).

May import: ``common``, ``ledger``, ``registry``, ``sandbox``. The packages of ``forgeflow`` import one way, in this
order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
