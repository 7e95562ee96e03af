"""ELDR where operators already route: predicted-signature pinning in host routers.

A thin pre-router (:mod:`.prerouter`) in front of the host router asks the ELDR
scorer (:mod:`.scorer`: in process, or ``POST /eldr/score`` of a running co-located
router) which decode worker the policy picks from the request's PREDICTED signature
and the live loads, and pins that worker in the host router:

* :mod:`.dynamo`: NVIDIA Dynamo's frontend, headers ``x-dynamo-worker-instance-id`` +
  ``x-dynamo-prefill-instance-id``, instance ids from the frontend's ``/health``;
* :mod:`.smg`: SMG (``sglang-router`` 0.3.2), ``--decode-policy manual`` with
  ``X-SMG-Routing-Key`` keys learned per decode worker and verified continuously
  against SMG's keys-in-flight gauge (:mod:`.smg_keys`), or one key per region.

Early binding only: the host routers choose before prefill. See docs/INTEGRATIONS.md.

    python -m eldr_sglang.integrations dynamo --host-url http://127.0.0.1:8000 \\
        --calibration artifact.json --port 8100
"""

from eldr_sglang.integrations.dynamo import DynamoPreRouter
from eldr_sglang.integrations.prerouter import PreRouter, serve
from eldr_sglang.integrations.scorer import Choice, LocalScorer, RemoteScorer
from eldr_sglang.integrations.smg import SmgPreRouter

__all__ = ["Choice", "DynamoPreRouter", "LocalScorer", "PreRouter", "RemoteScorer", "SmgPreRouter", "serve"]
