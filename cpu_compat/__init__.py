"""Start-up fixes for a CPU-only install, loaded by entry points before verl or vLLM run.

Kept apart from :mod:`patches` (whose import installs verl patches): these run from torch's and
vLLM's own plugin hooks, where importing verl would be too early or not wanted.

- :mod:`cpu_compat.cpu_mode`: CPU mode (``VERL_PLATFORM`` and the torch build), the one test the
  torch hook below and the verl patches share.
- :mod:`cpu_compat.torchvision_ops` (``torch.backends`` entry point, runs at ``import torch``):
  lets the registry's CUDA torchvision wheel import on a CPU torch build, in CPU mode only.
"""
