"""Glue for the tools people already train with: ``from smpart.integrations.transformers import Trainer``."""
