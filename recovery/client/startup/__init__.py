"""The directory the agent puts first on its ranks' `PYTHONPATH` (`recovery.agent.stephook`): its `sitecustomize`
installs the step hook (`recovery.client.steps`) in the rank's process before the script runs."""
