"""``python -m deployments.cli``: the ``forgeflow`` command line."""

from deployments.cli import main

main()
