"""Sweeps from one file: local subprocesses or SkyPilot managed jobs, and wandb dashboards."""
