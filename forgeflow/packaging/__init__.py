"""From checkpoint to release: base checkpoints, merge/convert/quantize, GGUF edits, publishing, lineage.

May import: ``common``, ``ledger``, ``registry``, ``sandbox``, ``curation``, ``evaluation``, ``training``.
"""
