"""The draft LM's training half: distillation's LightningModule, recipe schema and exporter (``module.py``,
which registers the kind); its engine half is ``core.drafters.draft_lm``."""
