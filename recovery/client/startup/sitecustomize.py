"""Run by Python at the start of a rank's interpreter (this directory is first on its `PYTHONPATH`): the step hook
(`recovery.client.steps`), then the `sitecustomize` this one hides, if the environment has one (a distribution's,
a site's), as if it were found alone."""

import importlib.machinery
import importlib.util
import os
import sys


def _hook() -> None:
    try:
        from recovery.client.steps import install_from_environment
    except ImportError:  # the rank's Python has no `recovery` (another environment): nothing counted
        return
    install_from_environment()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _hook()
except Exception as exc:  # a start-up hook never stops the script
    print(f"recovery: the step hook was not installed: {exc!r}", file=sys.stderr)
_chain()
