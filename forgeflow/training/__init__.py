"""Training bursts that continue an adapter lineage: SFT (``burst``), RL with verifier rewards
(``rl``), PPO through verl (``verl``), samples and windows from trajectories (``samples``,
``windows``).

May import: ``common``, ``ledger``, ``registry``, ``sandbox``, ``curation``, ``evaluation``. The packages of
``forgeflow`` import one way, in this order:
common < ledger < registry < sandbox < curation < evaluation < training < packaging < serving.
"""
