"""From checkpoint to release: the team's base checkpoint (``checkpoint``: local folder or HF Hub
revision), the tiny base model (``base_model``), merge/convert/quantize and the GGUF
check (``gguf``), bounded-memory GGUF edits (``gguf_edit``, checked by ``gguf_verify``; a package
run's typed set/add/delete edits in ``gguf_metadata``), the pinned llama.cpp sdist
(``sdist``), publishing (``publish``, ``release``) and the artifact lineage (``lineage``).

May import: ``common``, ``ledger``, ``registry``, ``sandbox``, ``curation``, ``evaluation``, ``training``. The packages
of ``forgeflow`` import one way, in this order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
