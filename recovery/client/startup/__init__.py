"""The directory the agent puts first on its ranks' `PYTHONPATH`: its `sitecustomize` installs the step hook
(`recovery.client.steps`) in the rank's process before the script runs."""

from pathlib import Path

DIRECTORY = str(Path(__file__).resolve().parent)
