"""Quieting what third-party libraries log at import that is not the user's concern."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


def quiet_torchao() -> contextlib.AbstractContextManager[None]:
    """torchao logs a deprecation notice of torch's at import; it is not the user's concern."""
    logger = logging.getLogger("torch.utils._pytree")

    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)

    return quiet()
