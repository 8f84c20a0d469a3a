"""H-RAD's training half (SpecBranch's draft-length classifier), one job a module: reading traces, the data module,
calibration, metrics and plots, the LightningModule (``module.py``, which registers the kind) and export."""
