"""Checkpoint evaluation, paper tables, figures and statistics."""
