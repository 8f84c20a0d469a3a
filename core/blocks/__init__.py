"""Model building blocks shared by the engine's runner and the drafters (transformers parameter names)."""
