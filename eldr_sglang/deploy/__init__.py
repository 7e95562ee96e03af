"""Launch generator for an ELDR PD cluster: YAML description -> per-node commands.

``spec`` validates the description, ``commands`` builds each server's and the
router's command line, ``files`` checks the artifact and placement files,
``presets`` ships the paper's setups, ``k8s`` writes Kubernetes manifests. CLI:
``python -m eldr_sglang.deploy``.
"""

from .commands import Launch, build_launches
from .presets import load_description, preset_names
from .spec import Cluster, DescriptionError, parse_cluster

__all__ = ["Cluster", "DescriptionError", "Launch", "build_launches", "load_description", "parse_cluster",
           "preset_names"]
