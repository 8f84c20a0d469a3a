"""Drafters as plain ``nn.Module`` s: training wraps them in LightningModules, the engine runs them directly."""
