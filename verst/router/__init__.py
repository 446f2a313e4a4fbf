"""Key-affinity routing over a fleet of engines: the in-process `Router` state and the HTTP
proxy around it (`make_router_app`, `verst route`)."""

from verst.router.policy import (
    ROUTING_KEY_HEADER,
    MissingRoutingKey,
    NoEngineAvailable,
    Router,
    split_rank,
)

__all__ = ["ROUTING_KEY_HEADER", "MissingRoutingKey", "NoEngineAvailable", "Router", "split_rank"]
