"""Expert placement per decode server (paper: TP x EP decode instances).

``optimizer`` places one layer, ``regions`` measures each decode server's expected
activation, ``plan`` places whole models and writes them, ``sglang_files`` writes and
reads back SGLang ``--init-expert-location`` files. CLI: ``python -m eldr_sglang.placement``.
"""

from .optimizer import LayerPlacement, default_map, evaluate, lower_bound, optimize_layer, slots_per_rank
from .plan import ModelPlacement, default_placement, place_model, plan_global, plan_per_server, write_plan
from .regions import RegionActivity, activity, assign_regions, region_activities, token_probabilities
from .sglang_files import MANIFEST, SERVER_FILE, parse_with_sglang, read_location_file, write_location_file

__all__ = [
    "LayerPlacement", "ModelPlacement", "RegionActivity", "MANIFEST", "SERVER_FILE",
    "activity", "assign_regions", "default_map", "default_placement", "evaluate", "lower_bound",
    "optimize_layer", "parse_with_sglang", "place_model", "plan_global", "plan_per_server",
    "read_location_file", "region_activities", "slots_per_rank", "token_probabilities",
    "write_location_file", "write_plan",
]
