"""A sandboxed live-kernel gateway for AI agents."""

__version__ = "0.1.0"
