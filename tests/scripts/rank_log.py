"""A logging setup keyed by rank, as training libraries keep one: a module-level logger the
first call configures with the process's rank in every line. Imported by rank_log_script.py."""
import logging
import sys

_logger: logging.Logger | None = None
_configured_for: int | None = None


def setup(rank: int) -> logging.Logger:
    """Configure this process's logger once (a second call keeps the first rank)."""
    global _logger, _configured_for
    if _logger is None:
        _logger = logging.Logger(f"train.{rank}")       # not in logging's process-wide registry
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"[train rank {rank}] %(message)s"))
        _logger.addHandler(handler)
        _configured_for = rank
    return _logger


def info(message: str) -> None:
    _logger.info(message)
