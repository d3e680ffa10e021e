"""Training bursts that continue an adapter lineage: SFT, RL with verifier rewards, PPO through verl.

May import: ``common``, ``ledger``, ``registry``, ``sandbox``, ``curation``, ``evaluation``.
"""
