"""Drafters as plain ``nn.Module`` s: training wraps them in LightningModules, the engine runs them directly. One
folder per kind (the module, its layouts and loader, ``kind.py`` registering its engine half); ``kinds.py`` is the
table of kinds; the rest is what several kinds share (docs/drafter_kinds.md)."""
