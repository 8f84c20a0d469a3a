"""The engine loop: every decoding algorithm as a strategy over per-request rows, batched across requests
(``loop.DecodeEngine``), with the per-request state and results (``state``) and row-wise forwards (``rows``)."""
