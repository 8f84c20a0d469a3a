"""A toy recipe ``spectrain.fit`` trains in seconds."""

from __future__ import annotations

TOY_RECIPE = """# @package _global_
kind: toy_regression
run_name: toy
model:
  hidden: 8
  dropout: 0.0
  step_seconds: 0.0
optim:
  lr: 0.05
data:
  batch_size: 16
trainer:
  max_steps: 6
  val_check_interval: 2
  checkpoint_every_n_steps: 2
  monitor: val/loss
  monitor_mode: min
  accelerator: cpu
  devices: 1
"""
