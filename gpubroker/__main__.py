"""``python -m gpubroker`` runs the ``gpubroker`` command."""

from .app import main

main()
