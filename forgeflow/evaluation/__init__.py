"""Evaluating a model: the endpoint client, the agent trial and its supervision, canary jobs, paired
comparison and the promotion gate, Harbor interop and the answer judge."""
