"""Images and registries: image references (``imageref``), credentials (``auth``), skopeo
(``skopeo``), the loopback registry server (``server``), migration between registries
(``migration``), the shard layout (``layout``), base/environment/task images (``images``) and the
pinned projects they are built from (``projects``).

May import: ``common``, ``ledger``. The packages of ``forgeflow`` import one way, in this order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
