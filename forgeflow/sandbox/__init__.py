"""Trials in sandboxes: the Sandbox protocol (``base``) and its backends (``podman``, ``kubernetes``,
chosen in ``backends``), the verifier (``verifier``, ``submission``: what of a submission reaches
it; ``grading``: status maps and the resolution rule) and the NOP/Oracle trial runner (``trial``)."""
