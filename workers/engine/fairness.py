"""Fair shares between tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024).

Each tenant's counter is the service it has received, in weighted tokens (``prompt`` per prompt
token when a request is first admitted, ``output`` per generated token) divided by its weight (a
tenant of weight 2 is owed twice the service). The scheduler admits, within a priority, the
waiting request of the tenant with the lowest counter. It is work-conserving (whoever waits is
admitted while a slot is free), and a tenant that arrives with nothing waiting or running is lifted
to the lowest counter among the active tenants: idling earns no credit to spend later. With no
tenant active at all the counters start again from zero.

The settings and the tests:
docs/internals.md#models-and-tenants-one-redis-several-models-many-api-keys.
"""

from __future__ import annotations

from collections import Counter

from workers.engine.request import Request
from workers.engine.types import TokenWeights


class VirtualTokenCounter:
    def __init__(self, weights: TokenWeights) -> None:
        self.weights = weights
        self.counters: dict[str, float] = {}  # tenant -> service received / its weight
        self._active: Counter[str] = Counter()  # tenant -> its requests waiting or running

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, request: Request) -> None:
        """A new request (not a preempted one coming back)."""
        tenant = request.params.tenant
        if not self._active[tenant]:
            active = [self.counter(t) for t, n in self._active.items() if n]
            if active:
                self.counters[tenant] = max(self.counter(tenant), min(active))
            else:
                self.counters.clear()
        self._active[tenant] += 1

    def leave(self, request: Request) -> None:
        """A request finished or was aborted."""
        tenant = request.params.tenant
        self._active[tenant] -= 1
        if not self._active[tenant]:
            del self._active[tenant]

    def charge_prompt(self, request: Request) -> None:
        self._charge(request, self.weights.prompt * len(request.prompt_token_ids))

    def charge_token(self, request: Request) -> None:
        self._charge(request, self.weights.output)

    def _charge(self, request: Request, cost: float) -> None:
        tenant = request.params.tenant
        self.counters[tenant] = self.counter(tenant) + cost / request.params.tenant_weight
