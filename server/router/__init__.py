"""Data parallelism: a router that spreads requests over several radixserve replicas, preferring the replica whose
prefix cache most likely holds the request's prompt (cache-aware routing).

Modules, from the bottom up:
  * ``tree``: ``PrefixTree``, an approximate radix tree over request text with LRU pruning;
  * ``policy``: the routing policies (``cache_aware``, ``round_robin``, ``least_load``) behind one interface;
  * ``text``: the routing text of a chat, completion or /generate request;
  * ``replicas``: ``ReplicaPool``, the replicas' health, load and counters, and the policy over them;
  * ``transport``: how a replica is reached (``HttpTransport``: by URL) and the retry-relevant failure kinds;
  * ``proxy``: forwarding one request (choose, send, retry while safe, relay bytes or stream);
  * ``app``: the router's FastAPI app (proxied routes, /health, /router_info, /flush_cache, health checks);
  * ``process``: ``radixserve router``; ``config``: its flags;
  * ``asgi_bridge`` and ``ray_serve``: the same router and engine replicas as Ray Serve deployments (needs Ray).
See docs/scaling.md.
"""
