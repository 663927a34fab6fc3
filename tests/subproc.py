"""Environments of the tests' subprocesses."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env(**extra: str) -> dict:
    """This process's environment, with jodpo importable."""
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


def cpu_env(devices: int, **extra: str) -> dict:
    """A subprocess on ``devices`` fake CPU devices, whatever jax's default backend is here (a GPU machine too):
    the CPU platform is pinned and the device count added to the XLA flags already set."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return env(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)
