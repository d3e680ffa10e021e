"""Trials in sandboxes: the Sandbox protocol (``base``) and its backends (``podman``, ``kubernetes``,
chosen in ``backends``), the verifier (``verifier``, ``submission``: what of a submission reaches
it; ``grading``: status maps and the resolution rule) and the NOP/Oracle trial runner (``trial``).

May import: ``common``, ``ledger``, ``registry``. The packages of ``forgeflow`` import one way, in this order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
