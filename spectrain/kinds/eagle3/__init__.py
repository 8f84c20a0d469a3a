"""EAGLE-3's training half: its LightningModule and recipe schema (``module.py``, which registers the kind),
its losses and its exporter; its engine half is ``core.drafters.eagle3``."""
