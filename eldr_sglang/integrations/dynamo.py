"""NVIDIA Dynamo (ai-dynamo 1.6.1): pin the ELDR decode worker in the frontend's KV router.

Dynamo's frontend takes an explicit target per request: with prefill/decode
disaggregation it needs BOTH ``x-dynamo-worker-instance-id: <decode instance>`` and
``x-dynamo-prefill-instance-id: <prefill instance>`` (one of them alone is a 400 in
disaggregated mode); the pinned request still runs through the frontend's
preprocessor, its prefill router and its KV transfer, only the choice is ours.

Worker identities come from the frontend itself: ``GET /health`` lists every live
instance (``component``, ``endpoint``, ``instance_id``), whatever the discovery
backend (file, etcd, Kubernetes). Decode workers are the instances of
``decode_component`` (``backend``, the default of ``python -m dynamo.mocker`` and
the engines' decode workers), prefill workers those of ``prefill_component``
(``prefill``), both on endpoint ``generate``. An instance that leaves discovery
(graceful stop, or its lease expiring after a crash) leaves the mapping at the next
refresh; a pinned instance the frontend refuses (400 unknown / 503 unavailable, as
for a crashed worker still listed) is quarantined and the request goes unpinned.

The prefill instance rotates round robin over the listed ones: ELDR has no opinion
on prefill, and Dynamo's own prefill choice needs the request unpinned (the frontend
takes the two headers together). ``pin_prefill=False`` sends the decode header alone
(keeps the KV router's prefill choice) where the frontend accepts it; a frontend that
answers such a pin 400 while it lists prefill workers (1.6.1 in disaggregated mode) is
not a refused worker: the request goes unpinned, a WARNING says so once, and both
headers are sent from then on.

Dynamo's admission control (busy thresholds: ``--active-decode-blocks-threshold``,
``--active-prefill-tokens-threshold[-frac]``) answers, checked on the 1.6.1 frontend over
mockers, ``529 {"message":"Service temporarily overloaded","type":"Overloaded","code":529}``
both for a busy pinned worker (while others are free) and for all workers busy; the status
is ``DYN_HTTP_OVERLOAD_STATUS_CODE`` (e.g. 503) with the same text. A 529, or a 503 whose
text says busy, overload or capacity, is ``busy``: the request is retried unpinned and
the worker is NOT quarantined (counter ``pinned_busy``); any other 400/404/503 to a pin
is a refused worker (quarantined when the unpinned retry succeeds).
"""

from __future__ import annotations

import itertools
import logging
import re
from typing import Any, Optional

import orjson

from eldr_sglang.integrations.prerouter import PreRouter
from eldr_sglang.integrations.scorer import Choice

logger = logging.getLogger("eldr_sglang.integrations")
DECODE_HEADER = "x-dynamo-worker-instance-id"
PREFILL_HEADER = "x-dynamo-prefill-instance-id"
BUSY = re.compile(rb"busy|overload|capacity|too many requests", re.I)
OVERLOADED = 529  # Dynamo 1.6.1's admission-control status unless DYN_HTTP_OVERLOAD_STATUS_CODE says otherwise


class DynamoPreRouter(PreRouter):
    kind = "dynamo"
    # 400: an instance id the frontend does not know; 503: one it lists but cannot reach;
    # 529: Dynamo's "Service temporarily overloaded" (its default DYN_HTTP_OVERLOAD_STATUS_CODE)
    repin_statuses = frozenset({400, 404, 503, OVERLOADED})

    def __init__(self, frontend_url: str, scorer: Any, *, decode_component: str = "backend",
                 prefill_component: str = "prefill", endpoint: str = "generate",
                 namespace: Optional[str] = None, pin_prefill: bool = True, **kw: Any) -> None:
        super().__init__(frontend_url, scorer, **kw)
        self.pin_prefill = pin_prefill  # False: the decode header alone, where the frontend takes it
        self.decode_component, self.prefill_component = decode_component, prefill_component
        self.endpoint, self.namespace = endpoint, namespace
        self.prefills: list[str] = []
        self._rr = itertools.count()

    async def discover(self) -> None:
        async with self.session.get(self.host_url + "/health", headers=self.control_headers) as r:
            doc = orjson.loads(await r.read())
        decodes, prefills = [], []
        for inst in doc.get("instances", []):
            if inst.get("endpoint") != self.endpoint:
                continue
            if self.namespace is not None and inst.get("namespace") != self.namespace:
                continue
            iid = str(inst.get("instance_id"))
            if inst.get("component") == self.decode_component:
                decodes.append(iid)
            elif inst.get("component") == self.prefill_component:
                prefills.append(iid)
        self.prefills = sorted(set(prefills))
        self.set_workers(sorted(set(decodes)))

    def pin_headers(self, choice: Choice) -> Optional[dict[str, str]]:
        headers = {DECODE_HEADER: choice.worker}
        if self.prefills and self.pin_prefill:  # disaggregated 1.6.1: the frontend needs both ids
            headers[PREFILL_HEADER] = self.prefills[next(self._rr) % len(self.prefills)]
        return headers

    def refusal(self, status: int, detail: bytes, pin: dict[str, str]) -> str:
        if status == OVERLOADED or (status == 503 and BUSY.search(detail)):
            return "busy"
        if status == 400 and PREFILL_HEADER not in pin and self.prefills and not self.pin_prefill:
            self.pin_prefill = True
            self.counters["decode_only_refused"] += 1
            logger.warning("dynamo: the frontend refuses a decode-only pin (%r): pinning prefill too "
                           "(Dynamo's KV-aware prefill choice is lost for pinned requests)", detail[:200])
            return "decode_only"  # not the worker's fault: no quarantine
        return "refused"

    def describe(self) -> dict:
        return {"prefills": self.prefills, "pin_prefill": self.pin_prefill, "decode_header": DECODE_HEADER,
                "prefill_header": PREFILL_HEADER}
