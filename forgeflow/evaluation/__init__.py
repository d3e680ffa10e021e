"""Evaluating a model: the model endpoint client (``model_client``), the agent trial (``agent``; its
mini-swe-agent wiring ``mswea`` and its container on the sandbox backend ``sandbox_env``) and
its supervision (``supervision``), canary jobs (``canary``; the canary flows' parameter groups:
``canary_params``; what they return:
``canary_result``), paired comparison (``compare``,
``paired_stats``), the promotion gate (``gate``), Harbor interop (``harbor``, ``harbor_import``,
``harbor_tasks``) and the answer judge (``judge``).

May import: ``common``, ``ledger``, ``registry``, ``sandbox``, ``curation``. The packages of ``forgeflow`` import one
way, in this order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
