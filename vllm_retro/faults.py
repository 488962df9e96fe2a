"""Faults injected on purpose, for the fault tests and the soak run (``bench/soak.py``).

Off unless the server's own environment sets ``VLLM_RETRO_INJECT_FAULTS=1`` (read once, at
import, in every process of the engine); nothing a client sends can switch it on. When it is
on, a request whose id contains ``retro-fault-<site>`` (a client sets the id with the
``X-Request-Id`` header) fails at ``<site>`` every time it gets there:

- ``index_build``: building any layer's index of the request raises (on the builder thread
  or in the step). The request decodes densely from its paged KV for its whole life.
- ``host_alloc``: laying the request's KV out in the host tier raises, as when the pool
  cannot grow. At the index build (the prompt's layout): as ``index_build``.
- ``host_alloc_late``: the same, at the request's first update block after its switch (the
  index already decodes). The request fails with an error to its client.
- ``update_worker``: the wave buffer's update worker raises in the request's jobs other
  than layouts: its host pool's room growth (the next layout grows the pool itself). Its
  answer is unchanged.
- ``kernel_row``: the decode kernel raises for a batch holding the request. The batch is
  decoded again row by row; the request's row still raises and the request fails with an
  error to its client; the other rows' answers are unchanged.

Every other request of the engine is untouched by design, and that is what the tests check.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

ENV = "VLLM_RETRO_INJECT_FAULTS"
SITES = ("index_build", "host_alloc", "host_alloc_late", "update_worker", "kernel_row")
ENABLED = os.environ.get(ENV) == "1"
"""Whether faults are injected in this process (fixed at import)."""
MARK = "retro-fault-"


class InjectedFault(RuntimeError):
    """A fault raised on purpose (see module docstring)."""


def _marked(site: str, request_id: str | None) -> bool:
    if request_id is None:
        return False
    at = request_id.find(MARK)
    while at >= 0:
        rest = request_id[at + len(MARK):]
        after = rest[len(site):len(site) + 1]
        if rest.startswith(site) and not (after.isalnum() or after == "_"):
            return True
        at = request_id.find(MARK, at + 1)
    return False


def check(site: str, request_id: str | None, enabled: bool | None = None) -> None:
    """Raise :class:`InjectedFault` when faults are on (``enabled``; None: :data:`ENABLED`)
    and ``request_id`` asks for one at ``site`` (one of :data:`SITES`)."""
    if site not in SITES:
        raise ValueError(f"unknown fault site {site!r}; accepted: {', '.join(SITES)}")
    if (ENABLED if enabled is None else enabled) and _marked(site, request_id):
        raise InjectedFault(f"injected fault at {site} for request {request_id}")


def check_any(site: str, request_ids: Iterable[str | None],
              enabled: bool | None = None) -> None:
    """:func:`check` for a batch: raises when any of ``request_ids`` asks for ``site``."""
    for rid in request_ids:
        check(site, rid, enabled)
