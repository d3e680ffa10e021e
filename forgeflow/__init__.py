"""forgeflow: the post-training lifecycle of an LLM coding agent (Prefect-free core).

Layering: ``flows`` -> ``tasks`` -> ``forgeflow``. Nothing in this package imports Prefect.
"""

__version__ = "0.1.0"
