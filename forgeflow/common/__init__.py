"""Shared foundations: errors, settings, atomic files and digests, names, the task model every stage shares
(:class:`forgeflow.common.task.Task`), pinned sdists, the llama.cpp build.

May import: the standard library and third-party packages only. The packages of ``forgeflow`` import one way,
in this order: common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
