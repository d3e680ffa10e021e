"""Shared foundations: the one exception hierarchy (``errors``), settings and environment
(``settings``), atomic files, digests and locks (``fsutil``), names valid for containers and pods
(``names``), pinned sdists (``sdists``) and the one llama.cpp build that llama-cpp-python and
``llama-server`` share (``llama_cpp_build``).

May import: the standard library and third-party packages only. The packages of ``forgeflow`` import one way, in this
order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
