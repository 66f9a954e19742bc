"""Loaded by every interpreter a test run starts (``make test`` puts this folder on PYTHONPATH):
the cyclic garbage collector runs less often, nothing else changes.

A test run starts hundreds of interpreters (pytest workers, launchers, verl drivers, Ray workers,
servers), and most of their CPU time is importing torch, tensordict, transformers and verl. Python
3.11's default thresholds (700, 10, 10) run a full collection every ~70,000 new objects while those
imports build millions: ~15 % of a verl import (``import verl.trainer.main_ppo``: 9.8 CPU-s at the
defaults, 7.9 at these thresholds) and ~14 % of a one-step CPU training run, every process
included (136 -> 118 CPU-s). Cycles are still collected, later. Training and evaluation outside
the tests keep Python's defaults; docs/training.md "Tests"."""

import gc

gc.set_threshold(50_000, 50, 100)
