"""Each drafter kind's training half, one folder per kind (``spectrain/kinds/<kind>/``: its LightningModule in
``module.py``, which registers the kind; its losses and exporter beside it), and what every kind's module shares
(``base.py``). The engine half of a kind is ``core/drafters/<kind>/``; docs/drafter_kinds.md lists what a kind holds."""
